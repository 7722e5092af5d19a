"""torchrun's environment in, and the launcher's failure summary out."""

from __future__ import annotations

import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest

from stoker.distributed.env import RankInfo
from stoker.distributed.launch import _describe_failure, inside_torchrun
from stoker.errors import ConfigError


def test_rank_info_reads_torchrun_variables():
    info = RankInfo.from_environ(
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RESTART_COUNT": "2"}
    )
    assert info == RankInfo(rank=3, local_rank=1, world_size=4, restart_count=2)
    assert info.distributed and not info.is_main


def test_rank_info_without_torchrun_is_rank_0_of_1():
    info = RankInfo.from_environ({})
    assert (info.rank, info.world_size, info.distributed, info.is_main) == (0, 1, False, True)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "two", "WORLD_SIZE": "4"}, "RANK='two' is not an integer"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "RANK=4 does not fit WORLD_SIZE=4"),
    ],
)
def test_rank_info_refuses_bad_values(environ, message):
    with pytest.raises(ConfigError, match=message):
        RankInfo.from_environ(environ)


def test_inside_torchrun_follows_its_variables(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert not inside_torchrun()
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert inside_torchrun()


def failure(pid: int, exitcode: int, timestamp: int) -> SimpleNamespace:
    return SimpleNamespace(pid=pid, exitcode=exitcode, timestamp=timestamp)


def test_failure_summary_names_the_first_rank_to_fail_and_its_signal():
    failed = SimpleNamespace(failures={0: failure(10, 1, 105), 1: failure(11, -9, 100)})
    assert _describe_failure(failed, max_restarts=2) == (
        "distributed run failed after 2 restart(s): rank 1 (pid 11) was killed by SIGKILL "
        "first; then rank 0 exited with code 1; each rank's own error is printed above"
    )


def test_a_rank_torchrun_stopped_in_the_same_second_is_not_named_the_cause():
    failed = SimpleNamespace(failures={0: failure(10, -15, 100), 1: failure(11, -6, 100)})
    assert _describe_failure(failed, max_restarts=1) == (
        "distributed run failed after 1 restart(s): rank 1 (pid 11) was killed by SIGABRT "
        "first; then rank 0 was killed by SIGTERM; each rank's own error is printed above"
    )


def test_failure_summary_of_one_rank_with_an_exit_code():
    failed = SimpleNamespace(failures={2: failure(12, 3, 100)})
    assert _describe_failure(failed, max_restarts=0) == (
        "distributed run failed: rank 2 (pid 12) exited with code 3 first; "
        "each rank's own error is printed above"
    )


def test_a_rank_killed_by_a_fatal_signal_prints_its_python_stack(tmp_path):
    # In a process of its own: faulthandler is process-wide state.
    script = tmp_path / "rank.py"
    script.write_text(
        "import faulthandler, os\n"
        "faulthandler.disable()  # as a fresh rank starts: no handler yet\n"
        "from stoker.cli.train import stacks_on_fatal_signals\n"
        "stacks_on_fatal_signals()\n"
        "def where_it_died():\n"
        "    os.abort()\n"
        "where_it_died()\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in done.stderr
    assert "in where_it_died" in done.stderr
