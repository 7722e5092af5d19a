"""One epoch number everywhere a user reads it: progress, messages, history, files, report.

Epochs count from 1. The model here scripts its validation loss epoch by epoch, so
which epoch is best and when early stopping fires are known in advance.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import stoker

OPTIONS = dict(
    batch_size=8,
    lr=0.01,
    loss="mse",
    log_every_steps=2,
    progress="plain",
    tensorboard=False,
    seed=0,
)


class ScriptedModel(nn.Module):
    """Trains like a linear layer; in eval mode outputs a constant whose square is the
    ``val/loss`` scripted for that evaluation (targets are zeros).

    ``nan_at`` makes the given training forward (counted from 1) return NaN; ``kill_at``
    makes it raise ``Killed``, as a process killed mid-epoch would stop.
    """

    def __init__(
        self, val_losses: list[float], *, nan_at: int | None = None, kill_at: int | None = None
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.linear = nn.Linear(2, 1)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(1, 2, generator=generator))
        self.val_losses = val_losses
        self.nan_at, self.kill_at = nan_at, kill_at
        self.evaluations = self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        if not self.training:
            self.evaluations += 1
            value = self.val_losses[min(self.evaluations, len(self.val_losses)) - 1] ** 0.5
            return out * 0 + value
        self.forwards += 1
        if self.forwards == self.kill_at:
            raise Killed
        if self.forwards == self.nan_at:
            return out * float("nan")
        return out


class Killed(BaseException):
    """Stands for a kill: no handler of stoker's turns it into something else."""


def data(rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 2, generator=generator), torch.zeros(rows, 1)


def fit(model: nn.Module, run_dir: Path, **options: Any) -> stoker.FitResult:
    train, val = data(32), data(8)  # 4 steps per epoch; one validation batch
    return stoker.fit(model, train, val, run_dir=run_dir, **{**OPTIONS, **options})


def progress_epochs(text: str) -> dict[int, str]:
    """Each ``epoch N/M ...`` summary line, by its N."""
    return {int(m[1]): m[0] for m in re.finditer(r"^epoch (\d+)/\d+ .*$", text, re.MULTILINE)}


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_best_epoch_is_the_same_in_every_place(tmp_path, capsys) -> None:
    # val/loss 9, 1, 4, 4: best at epoch 2, and patience 2 runs out after epoch 4 of 5.
    result = fit(
        ScriptedModel([9.0, 1.0, 4.0, 4.0, 4.0]),
        tmp_path,
        epochs=5,
        early_stopping={"patience": 2},
    )
    out = capsys.readouterr().out
    assert [r["epoch"] for r in result.history] == [1, 2, 3, 4]
    assert result.stopped_early
    best = min(result.history, key=lambda r: r["val/loss"])
    assert best["epoch"] == result.best_epoch == 2

    stop = re.search(r"^early stopping.*best 1\.0000 at epoch (\d+)\)$", out, re.MULTILINE)
    assert stop is not None, out
    assert int(stop[1]) == result.best_epoch
    assert "after epoch 4 of 5" in stop[0]

    lines = progress_epochs(out)
    assert sorted(lines) == [1, 2, 3, 4]
    assert "val/loss 1.0000" in lines[result.best_epoch]

    records = jsonl(tmp_path / "metrics.jsonl")
    epoch_records = [r for r in records if "val/loss" in r]
    assert [r["epoch"] for r in epoch_records] == [1, 2, 3, 4]
    first_steps = [r for r in records if r["step"] <= 4 and "val/loss" not in r]
    assert first_steps and {r["epoch"] for r in first_steps} == {1}  # step records too

    best_pointer = json.loads((tmp_path / "checkpoints" / "best.json").read_text())
    assert best_pointer["epoch"] == 2
    last_pointer = json.loads((tmp_path / "checkpoints" / "last.json").read_text())
    assert last_pointer["epoch"] == 4

    training = json.loads((tmp_path / "summary.json").read_text())["training"]
    assert training == {
        "epochs_done": 4,
        "epochs": 5,
        "stopped_early": True,
        "monitor": "val/loss",
        "mode": "min",
        "best_value": 1.0,
        "best_epoch": 2,
    }


def test_stopped_early_only_when_epochs_were_left(tmp_path, capsys) -> None:
    # val/loss 9, 1, 4, 4: patience 2 runs out after epoch 4.
    script = [9.0, 1.0, 4.0, 4.0]
    at_the_end = fit(
        ScriptedModel(script), tmp_path / "4", epochs=4, early_stopping={"patience": 2}
    )
    assert len(at_the_end.history) == 4
    assert not at_the_end.stopped_early
    assert "early stopping" not in capsys.readouterr().out
    summary = json.loads((tmp_path / "4" / "summary.json").read_text())
    assert summary["training"]["stopped_early"] is False

    before_the_end = fit(
        ScriptedModel(script), tmp_path / "5", epochs=5, early_stopping={"patience": 2}
    )
    assert len(before_the_end.history) == 4
    assert before_the_end.stopped_early
    assert "early stopping after epoch 4 of 5" in capsys.readouterr().out


def test_a_non_finite_loss_names_the_epoch_the_progress_shows(tmp_path, capsys) -> None:
    # The 6th training step is the 2nd of epoch 2 (4 steps per epoch).
    result = fit(ScriptedModel([1.0], nan_at=6), tmp_path, epochs=3, on_nonfinite="skip")
    out = capsys.readouterr().out
    warning = re.search(r"non-finite loss at step 6 \(epoch (\d+)\)", out)
    assert warning is not None, out
    epoch = int(warning[1])
    assert epoch == 2
    skipped = [r for r in result.history if r.get("numerics/skipped_steps")]
    assert [r["epoch"] for r in skipped] == [epoch]
    logged = [r for r in jsonl(tmp_path / "metrics.jsonl") if "numerics/skipped" in r]
    assert [(r["epoch"], r["step"]) for r in logged] == [(epoch, 6)]
    # The warning comes out while epoch 2 trains: after epoch 1's line, before epoch 2's.
    assert out.index("epoch 1/3") < warning.start() < out.index("epoch 2/3")


def test_a_halt_on_a_non_finite_loss_names_the_epoch(tmp_path) -> None:
    with pytest.raises(stoker.TrainingError, match=r"at step 6 \(epoch 2\)"):
        fit(ScriptedModel([1.0], nan_at=6), tmp_path, epochs=3, progress="quiet")


def test_a_run_resumed_mid_epoch_goes_on_with_the_same_numbers(tmp_path, capsys) -> None:
    # Killed in the 7th step, the 3rd of epoch 2, after the checkpoint of step 6.
    with pytest.raises(Killed):
        fit(ScriptedModel([3.0, 2.0, 1.0], kill_at=7), tmp_path, epochs=3, every_steps=1)
    first = capsys.readouterr().out
    assert sorted(progress_epochs(first)) == [1]

    result = fit(ScriptedModel([2.0, 1.0]), tmp_path, epochs=3, every_steps=1, resume=tmp_path)
    out = capsys.readouterr().out
    assert re.search(r"^resuming .* in epoch 2 \(step 6\)$", out, re.MULTILINE), out
    assert sorted(progress_epochs(out)) == [2, 3]
    assert [r["epoch"] for r in result.history] == [1, 2, 3]
    records = jsonl(tmp_path / "metrics.jsonl")
    assert [r["epoch"] for r in records if "val/loss" in r] == [1, 2, 3]
    page = (tmp_path / "report.html").read_text()
    categories = re.findall(r'data-series="time/data_wait_s" data-category="([^"]*)"', page)
    assert categories == ["1", "2", "3"]


def test_the_report_labels_epochs_as_the_run_did(tmp_path) -> None:
    # val/loss 9, 1, 0.95 with min_delta 0.1: 0.95 is no improvement, so epoch 2 is best.
    result = fit(
        ScriptedModel([9.0, 1.0, 0.95]),
        tmp_path,
        epochs=3,
        early_stopping={"patience": 5, "min_delta": 0.1},
        progress="quiet",
    )
    assert result.best_epoch == 2
    page = (tmp_path / "report.html").read_text()
    categories = re.findall(r'data-series="time/data_wait_s" data-category="([^"]*)"', page)
    assert categories == [str(r["epoch"]) for r in result.history] == ["1", "2", "3"]
    assert "<h3>Last epoch (epoch 3)</h3>" in page
    best = re.search(r"<td>best val/loss \(min\)</td><td>([^<]*)</td>", page)
    assert best is not None
    assert best[1].startswith("1 at epoch 2, step 8"), best[1]
    # Epoch-level points carry their epoch in the tooltip; the axis says how they count.
    assert "epoch 2 (step 8): val/loss (per epoch) = 1</title>" in page
    assert "epoch (from 1)" in page
