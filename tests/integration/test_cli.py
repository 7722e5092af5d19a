"""The `stoker` CLI as a user runs it: a subprocess for a missing config and ``--debug``;
the other cases run the same ``main`` in-process (tests/stoker_cli.py). The installed
``stoker demo`` runs as a real process in test_wheel.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stoker_cli import run_cli

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "digits.yaml"


def stoker(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_demo_trains_and_fills_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    done = run_cli("demo", "--epochs", "3", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    assert "epoch 3/3" in done.stdout
    assert f"run dir: {run_dir}" in done.stdout
    assert f"stoker demo --epochs 3 --resume {run_dir}" in done.stdout  # as it was started
    assert "tensorboard --logdir" in done.stdout
    for name in ("config.yaml", "metrics.jsonl", "model.safetensors", "checkpoints/last.json"):
        assert (run_dir / name).is_file(), name
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    epochs = [r for r in records if "val/accuracy" in r]
    assert len(epochs) == 3
    assert epochs[-1]["val/accuracy"] > 0.8
    step_records = [r for r in records if "val/accuracy" not in r and "train/loss" in r]
    assert step_records and {"step", "train/loss", "lr", "grad/norm"} <= set(step_records[0])
    health = [r for r in records if "grad/layer/0.weight" in r]
    assert health and "update_ratio/0.weight" in health[0]
    last = json.loads((run_dir / "checkpoints" / "last.json").read_text())["checkpoint"]
    bundle = torch.load(run_dir / "checkpoints" / last / "state.pt", weights_only=True)
    assert bundle["train_state"]["epoch"] == 3


def test_tensorboard_scalars_are_readable(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "tb-run"
    done = run_cli("train", str(EXAMPLE), "train.epochs=2", "--run-dir", str(run_dir), "--quiet")
    assert done.returncode == 0, done.stderr
    assert done.stdout == ""
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    accuracy = events.Scalars("val/accuracy")
    assert [event.step for event in accuracy] == [23, 46]  # 1438 train samples / 64 per step
    assert "train/loss" in events.Tags()["scalars"]


def test_resume_continues_the_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    # A cosine of a fixed length: one over the whole run could not be extended exactly.
    fixed = "schedule.total_steps=30"
    first = run_cli(
        "train", str(EXAMPLE), "train.epochs=1", fixed, "--run-dir", str(run_dir), "--quiet"
    )
    assert first.returncode == 0, first.stderr
    second = run_cli(
        "train",
        str(EXAMPLE),
        "train.epochs=2",
        fixed,
        "--resume",
        str(run_dir),
        "--progress",
        "plain",
    )
    assert second.returncode == 0, second.stderr
    assert "resuming" in second.stdout and "epoch 2/2" in second.stdout
    assert "epoch 1/2" not in second.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["epoch"] for r in records if "val/loss" in r] == [1, 2]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["train", "missing.yaml"], "config file not found: missing.yaml"),
        (["train", str(EXAMPLE), "model.name=nowhere.module:Net"], "cannot import module"),
        (["train", str(EXAMPLE), "train.epoch=2"], "did you mean 'epochs'"),
        (
            ["train", str(EXAMPLE), "model.args.out_features=5", "train.epochs=1"],
            "labels go up to 9",
        ),
        (
            [
                "train",
                str(EXAMPLE),
                "optim.lr=1e30",
                "optim.name=sgd",
                "schedule.warmup_steps=0",
                "train.epochs=1",
            ],
            "non-finite",
        ),
    ],
)
def test_errors_are_one_clear_message_without_traceback(tmp_path, args, expected) -> None:
    # The first case in a real process (nothing else on its stderr), the rest in-process.
    run = stoker if args == ["train", "missing.yaml"] else run_cli
    done = run(*args, "--run-dir", str(tmp_path / "x"), cwd=tmp_path)
    assert done.returncode != 0
    assert expected in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("stoker: error:")


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    done = stoker("train", "missing.yaml", "--debug", cwd=tmp_path)
    assert done.returncode != 0
    assert "Traceback" in done.stderr
