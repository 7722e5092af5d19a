"""data.bad_records=skip over a whole run: both splits logged, each record once, resumes too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import stoker
import stoker.train.loop as loop_module
from stoker.data import split_dataset
from stoker.data.records import BadSample

QUIET = dict(progress="quiet", tensorboard=False, batch_size=8, lr=0.05)


class Corrupt(Dataset):
    """40 samples of 4 features; the indices in ``broken`` are records that do not parse."""

    def __init__(self, broken: set[int]) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(40, 4, generator=generator)
        self.y = (self.x[:, 0] > 0).long()
        self.broken = broken

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        if i in self.broken:
            return BadSample(source="rows.bin", location=f"index {i}", reason="truncated")
        return self.x[i], self.y[i]


def one_in_each_split() -> tuple[int, int]:
    """A training index and a validation index of the val_fraction=0.25 split (seed 0)."""
    train, val = split_dataset(Corrupt(set()), 0.25, seed=0)
    return train.indices[3], val.indices[1]


def test_bad_records_of_both_splits_are_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    in_train, in_val = one_in_each_split()
    with caplog.at_level("WARNING", logger="stoker"):
        result = stoker.fit(
            torch.nn.Linear(4, 2),
            Corrupt({in_train, in_val}),
            val_fraction=0.25,
            bad_records="skip",
            epochs=3,
            run_dir=tmp_path / "run",
            **QUIET,
        )
    logged = [json.loads(line) for line in (tmp_path / "run" / "bad_records.jsonl").open()]
    assert [(r["location"], r["split"]) for r in logged] == [
        (f"index {in_train}", "train"),
        (f"index {in_val}", "val"),
    ]
    said = [r.getMessage() for r in caplog.records if "skipped bad record" in r.getMessage()]
    assert said == [
        f"skipped bad record (train): rows.bin, index {in_train}: truncated",
        f"skipped bad record (val): rows.bin, index {in_val}: truncated",
    ]
    assert [r["data/bad_records"] for r in result.history] == [2, 2, 2]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["data/bad_records"] for r in metrics if "val/loss" in r] == [2, 2, 2]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["data"] == {"bad_records": 2}


@pytest.mark.parametrize("killed_in_epoch", [1, 3])
def test_kill_and_resume_writes_no_record_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, killed_in_epoch: int
) -> None:
    """Killed after epoch 1's training (no checkpoint yet: the run restarts from the top)
    or when epoch 3 starts (resumed from epoch 2's checkpoint)."""
    in_train, in_val = one_in_each_split()
    data = Corrupt({in_train, in_val})
    options = dict(val_fraction=0.25, bad_records="skip", epochs=3, **QUIET)
    real_train_epoch = loop_module.train_epoch
    calls: list[int] = []

    def killed(loop):
        calls.append(loop.state.epoch)
        if len(calls) == 3:
            raise RuntimeError("killed")
        done = real_train_epoch(loop)
        if killed_in_epoch == 1:
            raise RuntimeError("killed")  # after the training records were written
        return done

    monkeypatch.setattr(loop_module, "train_epoch", killed)
    with pytest.raises(RuntimeError, match="killed"):
        stoker.fit(torch.nn.Linear(4, 2), data, run_dir=tmp_path / "run", **options)
    monkeypatch.setattr(loop_module, "train_epoch", real_train_epoch)

    resumed = stoker.fit(torch.nn.Linear(4, 2), data, resume=tmp_path / "run", **options)
    assert len(resumed.history) == 3
    logged = [json.loads(line) for line in (tmp_path / "run" / "bad_records.jsonl").open()]
    assert sorted((r["location"], r["split"]) for r in logged) == sorted(
        [(f"index {in_train}", "train"), (f"index {in_val}", "val")]
    )
    assert resumed.history[-1]["data/bad_records"] == 2
