"""The user's own code through the CLI: the two-headed example, and a callback that fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from stoker.checkpoint import find_latest, load_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "two_heads" / "two_heads.yaml"


def stoker(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )


def test_the_two_headed_example_trains_with_its_own_step_optimizer_and_callback(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    # From another folder than the example's: models.py resolves from the config's.
    done = stoker(
        "train", str(EXAMPLE), "--run-dir", str(run_dir), "--progress", "plain", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    epochs = [r for r in records if "val/loss" in r]
    first, last = epochs[0], epochs[-1]
    assert len(epochs) == 6
    for name in ("loss", "kind_loss", "weight_loss", "kind_accuracy", "weight_mae_kg"):
        assert f"train/{name}" in last and f"val/{name}" in last
    # Both heads learn: a constant guess scores kind accuracy ~0.5 and weight MAE ~1.8 kg.
    assert last["val/weight_mae_kg"] < 0.7 < first["val/weight_mae_kg"]
    assert last["val/kind_accuracy"] > 0.65
    assert abs(last["val/loss"] - last["val/kind_loss"] - last["val/weight_loss"]) < 1e-4
    # The callback logged to the run's sinks every 10 steps; its state is checkpointed.
    balance = [r["step"] for r in records if "balance/kind_share" in r]
    assert balance and all(step % 10 == 0 for step in balance)
    bundle = load_checkpoint(find_latest(run_dir))
    assert bundle["callbacks"]["LossBalance"]["steps"] == last["step"]
    assert "exp_avg" in next(iter(bundle["optimizer"]["state"].values()))  # Lion's state
    assert bundle["scheduler"]["total_steps"] == last["step"]  # OneCycleLR got the run's length
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["optim"]["name"] == f"{EXAMPLE.parent / 'models.py'}:Lion"
    assert saved["callbacks"][0]["name"] == f"{EXAMPLE.parent / 'models.py'}:LossBalance"
    assert (run_dir / "model.safetensors").is_file()


def test_a_callback_that_raises_ends_the_cli_run_with_its_name_and_no_traceback(
    tmp_path: Path,
) -> None:
    (tmp_path / "hooks.py").write_text(
        "class Broken:\n    def on_train_start(self, loop):\n        raise KeyError('val/f1')\n"
    )
    done = stoker(
        "train", str(EXAMPLE), "--run-dir", "run", "--quiet",
        "callbacks=[hooks.py:Broken]", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    assert "stoker: error: callback Broken.on_train_start raised KeyError: 'val/f1'" in done.stderr
    assert "Traceback" not in done.stderr
