"""examples/text.yaml: variable-length real text with padding, masks and bucketing."""

from __future__ import annotations

import json
from pathlib import Path

from stoker_cli import run_cli

EXAMPLE = Path(__file__).parents[2] / "examples" / "text.yaml"


def test_text_example_trains_and_beats_the_majority_class(tmp_path: Path) -> None:
    run_dir = tmp_path / "text"
    # In-process (the CLI's main, one intra-op thread): `stoker train` as a fresh process
    # is tested by test_zoo_tabular.py; here it would add only start-up time.
    done = run_cli("train", EXAMPLE, "train.epochs=3", "--run-dir", run_dir, "--quiet", threads=1)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    epochs = [r for r in records if "val/accuracy" in r]
    assert len(epochs) == 3
    # Majority class on this validation split: 0.334. The full example (10 epochs)
    # reaches 0.90; three epochs of the same model already pass 0.75.
    assert epochs[-1]["val/accuracy"] > 0.75
    assert epochs[-1]["train/loss"] < epochs[0]["train/loss"]
    # Fast enough to be an example: a few seconds an epoch, not minutes.
    assert max(r["time/epoch_s"] for r in epochs) < 30
