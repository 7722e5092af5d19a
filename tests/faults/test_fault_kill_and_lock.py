"""Fault injection with real processes: SIGKILL during saves, and the folder lock across processes.

One helper process imports torch once and forks a child per request (a fresh interpreter
per trial would spend seconds importing torch). The test kills the children with SIGKILL
at random moments, exactly as the kernel would end a run that is out of memory or preempted.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.checkpoint import Checkpointer, find_latest_valid, load_checkpoint
from stoker.checkpoint.layout import read_pointer
from stoker.errors import CheckpointError

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not hasattr(os, "fork"), reason="needs fork, SIGKILL and flock"
)

TRIALS = 25
KEEP_LAST = 2

SERVER = textwrap.dedent(
    """
    import json, os, random, sys, time, traceback
    from pathlib import Path

    import torch

    from stoker.checkpoint import Checkpointer, find_latest_valid, load_checkpoint


    def save_forever(directory, seed, keep_last):
        # Resume from the newest valid checkpoint, then save as fast as possible until killed.
        rng = random.Random(seed)
        ckpt = Checkpointer(directory, keep_last=keep_last)
        latest, _ = find_latest_valid(directory)
        state = load_checkpoint(latest, verify=False)
        ckpt.load_state_dict(state["checkpointer"])
        step = state["step"]
        while True:
            step += 1
            size = rng.choice([1, 16, 128, 512]) * 1024
            ckpt.save(
                {"step": step, "w": torch.full((size,), float(step))},
                epoch=step,
                step=step,
                metrics={"val/loss": rng.random()},
            )


    def hold_lock(directory, ready):
        ckpt = Checkpointer(directory)
        Path(ready).write_text("ready")
        while ckpt:
            time.sleep(60)


    def try_lock(directory, out):
        try:
            Checkpointer(directory).close()
            result = "acquired"
        except Exception as exc:
            result = str(exc)
        Path(out).write_text(result)


    COMMANDS = {"save_forever": save_forever, "hold_lock": hold_lock, "try_lock": try_lock}
    print(json.dumps({"ready": os.getpid()}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        command = request.pop("cmd")
        if command == "wait":
            _, status = os.waitpid(request["pid"], 0)
            print(json.dumps({"status": status}), flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                COMMANDS[command](**request)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
    """
)


class Forker:
    """Talks to the helper process: start a child doing one command, wait for a child."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.children: set[int] = set()
        self._reply(timeout=120)  # torch's import

    def _reply(self, *, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        assert ready, f"the helper process did not answer within {timeout} s"
        line = self.process.stdout.readline()
        assert line, f"the helper process died (exit code {self.process.poll()})"
        return json.loads(line)

    def _send(self, **request: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._reply(timeout=60)

    def start(self, command: str, **arguments: Any) -> int:
        pid = self._send(cmd=command, **arguments)["pid"]
        self.children.add(pid)
        return pid

    def wait(self, pid: int) -> int:
        """Waits for the child to end; returns its raw wait status."""
        status = self._send(cmd="wait", pid=pid)["status"]
        self.children.discard(pid)
        return status

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        status = self.wait(pid)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
            f"the child ended by itself (status {status}) before it was killed; see its stderr"
        )

    def close(self) -> None:
        for pid in list(self.children):
            with_suppressed_kill(pid)
        assert self.process.stdin is not None
        self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def with_suppressed_kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def forker() -> Iterator[Forker]:
    helper = Forker()
    yield helper
    helper.close()


def check_latest(directory: Path, previous_step: int) -> tuple[int, str]:
    """Checks what a killed save left; returns the latest step and a problem ('' if none)."""
    latest, skipped = find_latest_valid(directory)
    if latest is None:
        return previous_step, "no valid checkpoint left"
    if skipped:
        return previous_step, f"a completed checkpoint was damaged: {skipped}"
    state = load_checkpoint(latest)
    step = state["step"]
    if not torch.equal(state["w"], torch.full_like(state["w"], float(step))):
        return step, f"{latest} holds the wrong tensor"
    if step < previous_step:
        return step, f"latest went back from step {previous_step} to {step}"
    # The pointers may lag the newest folder by one save, but always name a valid one.
    for which in ("last", "best"):
        target = read_pointer(directory, which)  # type: ignore[arg-type]
        if target is None:
            return step, f"{which}.json names no checkpoint"
        load_checkpoint(target)
    kept = sorted(p.name for p in directory.glob("step-*"))
    if len(kept) > KEEP_LAST + 2:  # the newest k, the best, and one renamed before rotation
        return step, f"rotation fell behind: {kept}"
    return step, ""


def test_kill_during_saves_always_leaves_a_loadable_latest_checkpoint(
    tmp_path: Path, forker: Forker, record_property: Any
) -> None:
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory, keep_last=KEEP_LAST) as ckpt:
        ckpt.save({"step": 0, "w": torch.zeros(4)}, epoch=0, step=0, metrics={"val/loss": 1.0})
    rng = random.Random(20240611)
    passed, mid_write, step = 0, 0, 0
    problems: list[str] = []

    for trial in range(TRIALS):
        pid = forker.start(
            "save_forever", directory=str(directory), seed=trial, keep_last=KEEP_LAST
        )
        time.sleep(rng.uniform(0.05, 0.35))
        forker.kill(pid)
        # A .tmp- entry left behind means the kill landed inside a save (or a rotation).
        mid_write += any(p.name.startswith(".tmp-") for p in directory.iterdir())
        step, problem = check_latest(directory, step)
        if problem:
            problems.append(f"trial {trial}: {problem}")
        else:
            passed += 1

    summary = (
        f"kill-during-save: {passed}/{TRIALS} trials left a loadable, verified latest "
        f"checkpoint; {mid_write} kills landed mid-write; reached step {step}"
    )
    print(summary)
    record_property("kill_trials", TRIALS)
    record_property("kill_trials_passed", passed)
    record_property("kill_trials_mid_write", mid_write)
    assert problems == [], summary
    assert mid_write >= TRIALS // 4, f"too few kills hit a save to mean much: {summary}"
    assert step > 0, f"the children never completed a save: {summary}"
    # The next save clears every leftover of the killed ones.
    with Checkpointer(directory, keep_last=KEEP_LAST) as ckpt:
        ckpt.save({"step": step + 1, "w": torch.ones(1)}, epoch=0, step=step + 1)
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]


def test_a_second_process_is_refused_naming_the_pid_holding_the_lock(
    tmp_path: Path, forker: Forker
) -> None:
    directory = tmp_path / "checkpoints"
    out = tmp_path / "result.txt"
    holder = Checkpointer(directory)

    forker.wait(forker.start("try_lock", directory=str(directory), out=str(out)))
    message = out.read_text()
    assert "is locked by" in message, message
    assert f"pid {os.getpid()}" in message
    assert str(directory) in message

    holder.close()
    forker.wait(forker.start("try_lock", directory=str(directory), out=str(out)))
    assert out.read_text() == "acquired"


def test_the_lock_of_a_killed_process_does_not_block(tmp_path: Path, forker: Forker) -> None:
    directory = tmp_path / "checkpoints"
    ready = tmp_path / "ready"
    pid = forker.start("hold_lock", directory=str(directory), ready=str(ready))
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline, "the child never took the lock"
        time.sleep(0.01)

    with pytest.raises(CheckpointError, match=f"pid {pid}"):
        Checkpointer(directory)
    forker.kill(pid)

    # The kernel dropped the dead process's flock; its pid is still in the file.
    assert (directory / ".lock").read_text().strip() == str(pid)
    with Checkpointer(directory):
        assert (directory / ".lock").read_text().strip() == str(os.getpid())
