"""Every kind of metric reduced over 2 ranks equals one process's over the whole data.

One launch of 2 processes (gloo, CPU). The ranks hold uneven shares — rank 0 three
batches, rank 1 two smaller ones, and no regression batch at all — so averaging the
ranks' own figures (or weighing them equally) would give other numbers than the whole
set's, and a rank with no rows must still take part in the reduction.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from stoker.config import MetricSpec
from stoker.train.metric_set import build_metrics

pytestmark = pytest.mark.distributed

CPU = torch.device("cpu")
CLASS_SPECS = [
    "f1",
    MetricSpec(name="f1", args={"average": "micro"}, key="f1_micro"),
    MetricSpec(name="f1", args={"average": "weighted"}, key="f1_weighted"),
    "precision",
    "recall",
    "top2_accuracy",
]
REGRESSION_SPECS = ["r2", MetricSpec(name="r2", args={"average": "variance_weighted"}, key="r2_vw")]


def error_rate(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs.argmax(1) != targets).float().mean()


def abs_error(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return (outputs - targets).abs().mean()


def _data():
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 5, (61,), generator=generator)
    scores = torch.randn(61, 5, generator=generator) + torch.nn.functional.one_hot(labels, 5)
    real = 50 + 3 * torch.randn(23, 2, generator=generator)
    predicted = real + torch.randn(23, 2, generator=generator)
    # (rank, outputs, targets) per batch, in rank order.
    classes = [(0, 0, 20), (0, 20, 36), (0, 36, 40), (1, 40, 53), (1, 53, 61)]
    regression = [(0, 0, 10), (0, 10, 23)]  # rank 1 has no regression batch
    return (
        [(rank, scores[a:b], labels[a:b]) for rank, a, b in classes],
        [(rank, predicted[a:b], real[a:b]) for rank, a, b in regression],
    )


def _user_metrics():
    torchmetrics = pytest.importorskip("torchmetrics")
    return [
        (None, error_rate),
        ("tm_f1", torchmetrics.classification.MulticlassF1Score(num_classes=5, average="macro")),
    ]


def _figures(rank: int | None) -> dict[str, float]:
    """This rank's figures (None: one process with every batch)."""
    class_batches, regression_batches = _data()
    classification = build_metrics(CLASS_SPECS, _user_metrics()).start(device=CPU)
    for owner, outputs, targets in class_batches:
        if rank is None or owner == rank:
            classification.update(outputs, targets)
    regression = build_metrics(REGRESSION_SPECS, [(None, abs_error)]).start(device=CPU)
    for owner, outputs, targets in regression_batches:
        if rank is None or owner == rank:
            regression.update(outputs, targets)
    figures = classification.compute("val", reported={})
    figures.update(regression.compute("val", reported={}))
    return figures


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        figures = _figures(rank)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(figures))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_reduce_every_metric_to_the_whole_sets_figure(tmp_path) -> None:
    pytest.importorskip("torchmetrics")
    # Forked, not spawned: the ranks start from this process's imports (torch, stoker,
    # torchmetrics) instead of paying ~4 s of CPU each to import them again.
    mp.start_processes(
        _worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork"
    )
    whole = _figures(None)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert set(whole) == {
        "val/f1",
        "val/f1_micro",
        "val/f1_weighted",
        "val/precision",
        "val/recall",
        "val/top2_accuracy",
        "val/error_rate",
        "val/tm_f1",
        "val/r2",
        "val/r2_vw",
        "val/abs_error",
    }
    for figures in ranks:
        assert figures.keys() == whole.keys()
        for key, value in whole.items():
            assert figures[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    # The check can fail: rank 0's figures alone differ from the whole set's.
    alone = _figures(0)
    assert alone["val/f1"] != pytest.approx(whole["val/f1"])
    assert alone["val/error_rate"] != pytest.approx(whole["val/error_rate"])
