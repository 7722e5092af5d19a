"""examples/text/lm.yaml: a causal LM on packed byte-level text, through the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stoker.data.packing import unigram_perplexity
from stoker.examples.text import stdlib_lm_blocks
from stoker_cli import run_cli

EXAMPLE = Path(__file__).parents[2] / "examples" / "text" / "lm.yaml"


def test_the_packed_lm_beats_the_unigram_baseline_and_reports_tokens_per_s(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "lm"
    # In-process (the CLI's main, one intra-op thread): `stoker train` as a fresh process
    # is tested by test_zoo_tabular.py; here it would add only start-up time.
    done = run_cli(
        "train", EXAMPLE, "train.epochs=1", "train.max_steps=150", "--run-dir", run_dir, threads=1
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    (epoch,) = [r for r in records if "val/perplexity" in r]
    baseline = unigram_perplexity(
        stdlib_lm_blocks(split="train").targets(),
        stdlib_lm_blocks(split="val").targets(),
        vocab_size=257,
    )
    assert 20 < baseline < 30  # byte frequencies alone: about 24
    assert epoch["val/perplexity"] < 0.75 * baseline
    # Every position of a packed block is a real token: 64 tokens per sample.
    assert epoch["throughput/tokens_per_s"] > 0
    assert epoch["throughput/tokens_per_s"] == pytest.approx(64 * epoch["throughput/samples_per_s"])
    assert "tokens/s" in done.stdout
