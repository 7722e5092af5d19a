"""A rank killed mid-run: torchrun restarts the group, which resumes from the checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed


def test_restarted_group_resumes_and_ends_with_a_clean_runs_weights(
    clean_run, run_stoker, tmp_path
):
    # 12 epochs with checkpoints every 2 steps; the uninterrupted run is shared with
    # test_stop.py (conftest.py).
    config, clean_dir = clean_run

    # Rank 1 dies with SIGKILL on its 150th sample (epoch 1, step 5), in the first attempt only.
    killed = run_stoker(
        "train",
        str(config),
        "--nproc",
        "2",
        "--max-restarts",
        "1",
        "--run-dir",
        str(tmp_path / "elastic"),
        "--progress",
        "plain",
        env={"CASE_RANK": "1", "CASE_KILL_AT_SAMPLE": "150"},
    )
    # Both streams on failure: stdout tells which attempt a rank failed in.
    assert killed.returncode == 0, killed.stderr + killed.stdout[-4000:]
    # Killed in epoch 1 (its sample count includes the fingerprint's reads), after a checkpoint.
    assert "restarted by torchrun (restart 1)" in killed.stdout
    assert "resuming" in killed.stdout and "in epoch 1 (step 2)" in killed.stdout
    assert "[rank 0] rank 0: a collective at batch" in killed.stderr

    expected = load_file(clean_dir / "model.safetensors")
    got = load_file(tmp_path / "elastic" / "model.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
    # The epoch metrics, summed over both ranks across the restart, are the clean run's too.
    assert epoch_losses(tmp_path / "elastic") == epoch_losses(clean_dir)


def epoch_losses(run_dir):
    records = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [
        (r["epoch"], r["train/loss"], r["train/accuracy"]) for r in records if "time/epoch_s" in r
    ]
