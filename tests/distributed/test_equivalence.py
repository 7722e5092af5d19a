"""2 ranks with batch 32 each train the same model as 1 process with batch 64."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stoker.checkpoint import load_checkpoint
from stoker_cli import run_cli

pytestmark = pytest.mark.distributed
CASE = Path(__file__).with_name("case.py")


def epoch_records(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "time/epoch_s" in r]


def held_out_record(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (record,) = [r for r in map(json.loads, lines) if "test/loss" in r]
    return {key: value for key, value in record.items() if key[:5] in ("test/", "epoch")}


def best_weights_test_loss(run_dir):
    """The mean cross entropy over case.py's samples of the run's best checkpoint."""
    spec = importlib.util.spec_from_file_location("stoker_case", CASE)
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    best = json.loads((run_dir / "checkpoints" / "best.json").read_text())["checkpoint"]
    model = case.model()
    model.load_state_dict(load_checkpoint(run_dir / "checkpoints" / best)["model"])
    features, labels = case._features()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(features), labels).item()


def step_losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        (r["step"], r["train/loss"])
        for r in map(json.loads, lines)
        if "train/loss" in r and "time/epoch_s" not in r
    ]


@pytest.mark.parametrize(("shuffle", "accum"), [(True, 1), (False, 2)])
def test_two_ranks_of_32_equal_one_process_of_64(
    tmp_path, write_config, run_stoker, shuffle, accum
):
    """Shuffled or not, each rank takes every 2nd sample of the same order; with gradient
    accumulation too (DDP's no_sync on every micro-batch but a step's last)."""
    config = write_config(
        # A test set (the whole 320 samples), and metrics that need the whole set's counts.
        data={"val_fraction": 0.2, "test": {"name": f"{CASE}:samples"}},
        # Checkpoints, with the first epoch made the best: every rank tests its weights.
        checkpoint={"enabled": True},
        train={
            "epochs": 3,
            "grad_accum_steps": accum,
            "metrics": ["f1", "precision", "recall"],
            "monitor": "val/loss",
            "monitor_mode": "max",
        },
        loader={"shuffle": shuffle},
    )
    ddp, single = tmp_path / "ddp", tmp_path / "single"

    two = run_stoker("train", str(config), "--nproc", "2", "--run-dir", str(ddp), "--quiet")
    assert two.returncode == 0, two.stderr
    # The one process runs in this one (one intra-op thread, as the ranks have).
    one = run_cli(
        "train", config, "loader.batch_size=64", "--run-dir", single, "--quiet", threads=1
    )
    assert one.returncode == 0, one.stderr

    weights_ddp = load_file(ddp / "model.safetensors")
    weights_one = load_file(single / "model.safetensors")
    assert weights_ddp.keys() == weights_one.keys()
    worst = 0.0
    for name, tensor in weights_one.items():
        difference = (weights_ddp[name] - tensor).abs().max() / tensor.abs().max()
        worst = max(worst, float(difference))
    print(f"largest relative weight difference, 2x32 vs 1x64: {worst:.3e}")
    assert worst <= 1e-6

    # Metrics reduced over ranks equal one process's: the same samples, the same sums.
    for reduced, whole in zip(epoch_records(ddp), epoch_records(single), strict=True):
        assert reduced["val/accuracy"] == whole["val/accuracy"]
        assert reduced["val/loss"] == pytest.approx(whole["val/loss"], rel=1e-5)
        assert reduced["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-5)
        assert reduced["train/accuracy"] == whole["train/accuracy"]
        for name in ("f1", "precision", "recall"):
            assert reduced[f"val/{name}"] == pytest.approx(whole[f"val/{name}"], rel=1e-9)
    # The test set, evaluated once at the end with the best weights, on both ranks' shares.
    test_ddp, test_one = held_out_record(ddp), held_out_record(single)
    assert test_ddp["epoch"] == test_one["epoch"] == 1
    assert test_ddp.keys() == test_one.keys() >= {"test/loss", "test/accuracy", "test/f1"}
    for key, value in test_one.items():
        assert test_ddp[key] == pytest.approx(value, rel=1e-5), key
    # The best (first epoch's) weights were tested, not the last: worked out here.
    assert test_one["test/loss"] == pytest.approx(best_weights_test_loss(single), rel=1e-5)
    # Step-level records too: the loss averaged over the ranks is the whole batch's.
    ddp_steps, one_steps = step_losses(ddp), step_losses(single)
    assert [step for step, _ in ddp_steps] == [step for step, _ in one_steps]
    assert len(ddp_steps) == 12 // accum  # 4 batches an epoch, 3 epochs, each step recorded
    for (_, reduced), (_, whole) in zip(ddp_steps, one_steps, strict=True):
        assert reduced == pytest.approx(whole, rel=1e-5)
    # Training moved the model (the comparison is not of two untouched models).
    records = epoch_records(single)
    assert records[-1]["train/loss"] < records[0]["train/loss"] - 0.05
    # Only rank 0 wrote: one metrics file, no rank files.
    assert not list(ddp.glob("*.rank1.*"))
