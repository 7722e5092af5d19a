"""A run dir is not trusted: no file stoker writes there is written through a link.

A symlink planted in a run dir (``metrics.jsonl -> ~/.bashrc``) would make a resumed run
append to or overwrite a file outside it. Each writer refuses, and the file outside is
left untouched; so are hard links and FIFOs.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import stoker
from stoker.checkpoint import Checkpointer
from stoker.config import RunConfig, write_config
from stoker.data.fingerprint import fingerprint_dataset, write_fingerprint
from stoker.data.records import BadRecordLog, BadSample
from stoker.errors import StokerError
from stoker.observe.report import write_report
from stoker.observe.sinks import JsonlSink
from stoker.safe_files import RunFileError, open_append, write_text

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="symlinks need admin rights")

PRECIOUS = "a file outside the run dir\n"


def _bad_records(run_dir: Path) -> None:
    log = BadRecordLog(run_dir / "bad_records.jsonl")
    log.record_bad([BadSample(source="a.csv", location="line 3", reason="bad")])


def _report(run_dir: Path) -> None:
    (run_dir / "config.yaml").write_text("name: x\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "train/loss": 0.5}\n')
    write_report(run_dir)


WRITERS: dict[str, Callable[[Path], Any]] = {
    "checkpoints/.lock": lambda run_dir: Checkpointer(run_dir / "checkpoints"),
    "metrics.jsonl": lambda run_dir: JsonlSink(run_dir / "metrics.jsonl"),
    "config.yaml": lambda run_dir: write_config(RunConfig(), run_dir / "config.yaml"),
    "bad_records.jsonl": _bad_records,
    "data_fingerprint.json": lambda run_dir: write_fingerprint(
        fingerprint_dataset(torch.utils.data.TensorDataset(torch.zeros(4, 2))), run_dir
    ),
    "report.html": _report,
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_symlink_in_the_run_dir_is_refused_and_its_target_untouched(
    tmp_path: Path, name: str
) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    run_dir = tmp_path / "run"
    (run_dir / name).parent.mkdir(parents=True)
    (run_dir / name).symlink_to(outside)
    with pytest.raises(StokerError, match="is a symbolic link"):
        WRITERS[name](run_dir)
    assert outside.read_text() == PRECIOUS
    assert (run_dir / name).is_symlink()


def test_a_resume_into_a_run_dir_with_a_planted_link_is_refused(
    tmp_path: Path, toy_classification: Any
) -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 3))

    options = dict(batch_size=128, progress="quiet", tensorboard=False, fingerprint="off")
    stoker.fit(model(), toy_classification, epochs=1, run_dir=tmp_path / "run", **options)
    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    for name in ("environment.json", "summary.json"):
        (tmp_path / "run" / name).unlink()
        (tmp_path / "run" / name).symlink_to(outside)
    with pytest.raises(RunFileError, match="environment.json is a symbolic link"):
        stoker.fit(model(), toy_classification, epochs=2, resume=tmp_path / "run", **options)
    assert outside.read_text() == PRECIOUS


def test_hard_links_and_fifos_are_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    os.link(outside, tmp_path / "metrics.jsonl")
    with pytest.raises(RunFileError, match="hard link"):
        open_append(tmp_path / "metrics.jsonl")
    os.mkfifo(tmp_path / "summary.json.fifo")
    with pytest.raises(RunFileError, match="FIFO"):
        open_append(tmp_path / "summary.json.fifo")  # would block forever if opened
    assert outside.read_text() == PRECIOUS
    # An ordinary file is replaced whole, and a missing one created.
    write_text(tmp_path / "summary.json", "{}")
    assert (tmp_path / "summary.json").read_text() == "{}"
    assert not list(tmp_path.glob(".summary.json.*"))


def test_a_link_to_a_file_written_at_the_end_is_refused_before_training(
    tmp_path: Path, toy_classification: Any
) -> None:
    """summary.json and report.html are written when the run ends, bad_records.jsonl at
    the first bad record: a link planted there stops the resume before its first step,
    not after hours of training."""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 3))

    options = dict(batch_size=128, progress="quiet", tensorboard=False, fingerprint="off")
    run_dir = tmp_path / "run"
    stoker.fit(model(), toy_classification, epochs=1, run_dir=run_dir, **options)
    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    trained = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for name in ("summary.json", "report.html", "bad_records.jsonl"):
        (run_dir / name).unlink(missing_ok=True)
        (run_dir / name).symlink_to(outside)
        with pytest.raises(RunFileError, match=f"{name} is a symbolic link"):
            stoker.fit(model(), toy_classification, epochs=2, resume=run_dir, **options)
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == trained
        assert outside.read_text() == PRECIOUS
        (run_dir / name).unlink()


def test_stoker_evaluate_writes_its_metrics_file_without_following_a_link(tmp_path: Path) -> None:
    from stoker.inference import write_evaluation

    outside = tmp_path / "outside.txt"
    outside.write_text(PRECIOUS)
    planted = tmp_path / "eval-best.json"  # where `stoker evaluate RUN_DIR` writes
    planted.symlink_to(outside)
    with pytest.raises(RunFileError, match="eval-best.json is a symbolic link"):
        write_evaluation({"metrics": {"eval/loss": 0.5}}, planted)
    assert outside.read_text() == PRECIOUS
    planted.unlink()
    write_evaluation({"metrics": {"eval/loss": float("nan")}}, planted)
    assert json.loads(planted.read_text()) == {"metrics": {"eval/loss": None}}
