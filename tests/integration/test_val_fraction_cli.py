"""A config with data.val_fraction, as users write it: bucketing and bad records in both splits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from stoker.data import split_dataset
from stoker_cli import run_cli

EXAMPLES = Path(__file__).parents[2] / "examples"


def stoker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_bucketed_jsonl_with_val_fraction_logs_each_bad_line_once(tmp_path: Path) -> None:
    # One broken line in the training part and one in the validation part of the split.
    train, val = split_dataset(TensorDataset(torch.zeros(90)), 0.2, seed=0)
    in_train, in_val = int(train._origin[1][5]), int(val._origin[1][2])
    lines = [json.dumps({"text": "ab" * (1 + i % 30), "label": i % 2}) for i in range(90)]
    lines[in_train], lines[in_val] = "{broken", json.dumps({"text": "no label"})
    (tmp_path / "text.jsonl").write_text("\n".join(lines) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name": "text_classifier",
                  "args": {"vocab_size": 257, "num_classes": 2, "embed_dim": 8, "hidden": 8}},
        "data": {"train": {"name": "jsonl", "args": {"path": "text.jsonl"}},
                 "val_fraction": 0.2, "bad_records": "skip"},
        "loader": {"batch_size": 16, "sampler": "bucket", "collate_fn": "pad"},
        "train": {"epochs": 2}, "tracking": {"tensorboard": False},
    }))  # fmt: skip
    # In-process: stderr holds stoker's log lines as the CLI's process writes them.
    done = run_cli("train", str(config), "--quiet", "--run-dir", str(tmp_path / "run"))
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    epochs = [r for r in records if "val/loss" in r]
    assert [(r["epoch"], r["data/bad_records"]) for r in epochs] == [(1, 2), (2, 2)]
    bad = [json.loads(line) for line in (tmp_path / "run" / "bad_records.jsonl").open()]
    assert [(r["location"], r["split"]) for r in bad] == [
        (f"line {in_train + 1}", "train"),
        (f"line {in_val + 1}", "val"),
    ]
    said = [
        match.groups()
        for line in done.stderr.splitlines()
        if (match := re.search(r"skipped bad record \((\w+)\): .*, (line \d+):", line))
    ]
    assert said == [("train", f"line {in_train + 1}"), ("val", f"line {in_val + 1}")]


@pytest.mark.slow
def test_text_example_with_val_fraction_instead_of_a_val_set(tmp_path: Path) -> None:
    done = stoker(
        "train", str(EXAMPLES / "text.yaml"), "data.val=null", "data.val_fraction=0.2",
        "data.train.args.split=all", "data.train.args.max_length=32", "model.args.hidden=16",
        "train.epochs=1", "train.max_steps=3", "--quiet", "--run-dir", str(tmp_path / "run"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["epoch"] for r in records if "val/accuracy" in r] == [1]
