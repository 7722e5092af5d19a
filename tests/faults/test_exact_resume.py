"""Kill -9 a run at several points and resume it in a new process: the final model,
optimizer, scheduler and scaler state are bitwise equal to an uninterrupted run."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
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

# One helper process imports torch, stoker and resume_child once, then forks a child per
# run: each run is a new process (killed by SIGKILL, resumed in another), without the ~4 s
# of CPU a fresh interpreter spends importing torch. The helper itself runs nothing but
# fork, so every child starts from the same state, as a fresh `python resume_child.py`.
# (The fork-server pattern of test_fault_kill_and_lock.py.)
SERVER = textwrap.dedent(
    """
    import json, os, sys, traceback

    sys.path.insert(0, {folder!r})
    import resume_child
    import torch

    # The first optimizer step imports what PyTorch loads lazily (~2 s of CPU, in every
    # child otherwise); a step on a throwaway tensor draws no random numbers.
    weight = torch.zeros(1, requires_grad=True)
    weight.grad = torch.zeros(1)
    torch.optim.SGD([weight], lr=0.1).step()
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(log, 1)
                os.dup2(log, 2)
                sys.argv = [resume_child.__file__, *request["argv"]]
                resume_child.main()
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({{"status": status}}), flush=True)
    """
).format(folder=str(CHILD.parent))


class Runner:
    """Runs ``resume_child.py RUN_DIR WORKERS KILL_AT [--resume]`` in a forked process."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._reply() == "ready"

    def _reply(self, timeout: float = 300) -> str:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        assert ready, f"no answer from the run helper in {timeout} s"
        return self.process.stdout.readline().strip()

    def run(self, argv: list[str], log: Path) -> subprocess.CompletedProcess[str]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"argv": argv, "log": str(log)}) + "\n")
        self.process.stdin.flush()
        status = json.loads(self._reply())["status"]
        # The code subprocess.run would give: minus the signal for a process killed by one.
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        return subprocess.CompletedProcess(argv, code, "", log.read_text())

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def runner() -> Iterator[Runner]:
    helper = Runner()
    yield helper
    helper.close()


def _run(runner: Runner, run_dir: Path, workers: int, kill_at: str, *, resume: bool = False):
    argv = [str(run_dir), str(workers), kill_at] + (["--resume"] if resume else [])
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = run_dir.parent / f"{run_dir.name}-{kill_at}{'-resume' if resume else ''}.log"
    return runner.run(argv, log)


def _final_state(run_dir: Path) -> dict:
    bundle = load_checkpoint(find_latest(run_dir))
    return {key: bundle[key] for key in ("model", "optimizer", "scheduler", "precision",
                                         "train_state")}  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory, runner) -> dict[int, dict]:
    states = {}
    for workers in (0, 2):
        run_dir = tmp_path_factory.mktemp(f"straight-{workers}") / "run"
        done = _run(runner, run_dir, workers, "never")
        assert done.returncode == 0, done.stderr
        states[workers] = _final_state(run_dir)
    return states


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kill_at", KILL_POINTS)
def test_killed_run_resumes_bitwise(tmp_path, runner, reference, workers, kill_at) -> None:
    run_dir = tmp_path / "run"
    killed = _run(runner, run_dir, workers, kill_at)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = _run(runner, run_dir, workers, kill_at, resume=True)
    assert resumed.returncode == 0, resumed.stderr
    assert_bitwise_equal(reference[workers], _final_state(run_dir))
    assert (run_dir / "model.safetensors").is_file()
