"""A loader worker forked while stop signals are held back survives one sent before its init."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from stoker.data.worker_watch import ignore_stop_signals, stop_signals_blocked

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not hasattr(signal, "pthread_sigmask"), reason="POSIX signals"
)


def _fork_worker_and_signal_it_before_its_init() -> int:
    """Fork a 'worker' that runs its init late; SIGTERM it first. Its wait status."""
    init_r, init_w = os.pipe()
    with stop_signals_blocked():
        pid = os.fork()
        if pid == 0:  # the worker: its init (ignore_stop_signals) comes a moment later
            try:
                os.read(init_r, 1)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh worker has it
                ignore_stop_signals()
                time.sleep(0.05)  # a pending SIGTERM would be delivered by now
            finally:
                os._exit(0)
    os.kill(pid, signal.SIGTERM)  # the group signal, before the worker's init ran
    os.write(init_w, b"x")
    _, status = os.waitpid(pid, 0)
    os.close(init_r)
    os.close(init_w)
    return status


def test_a_worker_signalled_before_its_init_is_not_killed() -> None:
    status = _fork_worker_and_signal_it_before_its_init()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
        f"the worker died of signal {os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}"
    )


def test_the_block_ends_with_the_fork() -> None:
    with stop_signals_blocked():
        assert signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
