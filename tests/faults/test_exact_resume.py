"""Kill -9 a run at several points and resume it in a new process: the final model,
optimizer, scheduler and scaler state are bitwise equal to an uninterrupted run."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from bitwise import assert_bitwise_equal

from stoker.checkpoint import find_latest, load_checkpoint

CHILD = Path(__file__).with_name("resume_child.py")
# Mid-epoch, at an epoch's end and after the last step in `make test`; two more mid-epoch
# points (the first step; the second epoch) in `make bench`'s slow run: the same resume
# path at other positions, ~10 s of two processes each.
KILL_POINTS = [
    pytest.param("step:0", marks=pytest.mark.slow),
    "step:4",
    "epoch_end:0",
    pytest.param("step:13", marks=pytest.mark.slow),
    "after_last",
]


def _run(run_dir: Path, workers: int, kill_at: str, *, resume: bool = False):
    args = [sys.executable, str(CHILD), str(run_dir), str(workers), kill_at]
    return subprocess.run(
        args + (["--resume"] if resume else []), capture_output=True, text=True, timeout=300
    )


def _final_state(run_dir: Path) -> dict:
    bundle = load_checkpoint(find_latest(run_dir))
    return {key: bundle[key] for key in ("model", "optimizer", "scheduler", "precision",
                                         "train_state")}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, dict]:
    states = {}
    for workers in (0, 2):
        run_dir = tmp_path_factory.mktemp(f"straight-{workers}") / "run"
        done = _run(run_dir, workers, "never")
        assert done.returncode == 0, done.stderr
        states[workers] = _final_state(run_dir)
    return states


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_killed_run_resumes_bitwise(tmp_path, reference, workers, kill_at) -> None:
    run_dir = tmp_path / "run"
    killed = _run(run_dir, workers, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = _run(run_dir, workers, kill_at, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(reference[workers], _final_state(run_dir))
    assert (run_dir / "model.safetensors").is_file()
