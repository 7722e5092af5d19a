"""SIGTERM to the launcher: every rank stops after the same step, saves, and resumes exactly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from stoker_cli import run_cli

pytestmark = pytest.mark.distributed


def test_sigterm_stops_all_ranks_at_one_step_and_the_resume_is_exact(
    clean_run, run_stoker, tmp_path
):
    # 12 epochs with checkpoints every 2 steps; the uninterrupted run is shared with
    # test_elastic.py (conftest.py).
    config, clean_dir = clean_run

    run_dir = tmp_path / "stopped"
    log = tmp_path / "launcher.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(
            [
                *(sys.executable, "-m", "stoker", "train", str(config), "--nproc", "2"),
                *("--run-dir", str(run_dir), "--progress", "plain"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "CASE_SAMPLE_DELAY_S": "0.002"},
        )
        deadline = time.monotonic() + 120
        while "epoch 2/12" not in log.read_text() and time.monotonic() < deadline:
            assert launcher.poll() is None, log.read_text()
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 130, log.read_text()
    output = log.read_text()
    steps = {
        int(rank): int(step)
        for rank, step in re.findall(r"\[rank (\d)\] stopped by SIGTERM after step (\d+)", output)
    }
    assert set(steps) == {0, 1} and steps[0] == steps[1], output
    assert "checkpoint saved" in output
    assert f"--nproc 2 --resume {run_dir}" in output

    # On another number of processes the resume could not be exact: refused, naming why.
    # (In-process: it is refused before anything runs.)
    alone = run_cli("train", config, "--resume", run_dir, "--quiet")
    assert alone.returncode != 0
    assert "world size (processes): 2 in the checkpoint, 1 now" in alone.stderr

    resumed = run_stoker("train", str(config), "--nproc", "2", "--resume", str(run_dir), "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    expected = load_file(clean_dir / "model.safetensors")
    got = load_file(run_dir / "model.safetensors")
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name
