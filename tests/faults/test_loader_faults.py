"""Fault injection in loader workers: killed, crashed, hung, failing, out of shared memory.

Each test runs a real DataLoader with two worker processes and a dataset (in
``loader_datasets.py`` beside this file) that fails on purpose at one sample. It checks
the error a person gets (type, the worker named, cause and fix), that it came within a
time bound, and that no worker process outlives it. Out-of-shared-memory cannot be
provoked on a CI machine; it is injected as PyTorch reports it: a worker killed by
SIGBUS, or the RuntimeError PyTorch raises when a shared-memory file cannot be written.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from stoker import build_loader
from stoker.config import LoaderConfig
from stoker.data.records import BadRecordError
from stoker.data.text import JsonlDataset
from stoker.data.worker_faults import SampleError
from stoker.errors import DataError
from stoker_cli import run_cli

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from loader_datasets import Faulty, FaultyBatches, RaisingCollate  # noqa: E402

pytestmark = pytest.mark.skipif(
    sys.platform == "win32" or not hasattr(os, "fork"), reason="needs fork and POSIX signals"
)

WORKERS = 2


def _pids(pid_dir: Path) -> set[int]:
    return {int(p.name) for p in pid_dir.iterdir()} - {os.getpid()}


def assert_no_workers_left(pid_dir: Path) -> None:
    """Every worker that read the dataset is gone: not running, not a zombie, not a child."""
    pids = _pids(pid_dir)
    assert pids, "no worker read the dataset"
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    assert not pids & children, f"workers still children of the test: {pids & children}"
    assert not [pid for pid in pids if psutil.pid_exists(pid)], "worker processes left"


def fail_loading(loader: Any, *, consume: Callable[[Any], None] | None = None) -> tuple:
    """Iterate ``loader`` until it raises; returns (the exception, seconds it took)."""
    started = time.monotonic()
    with pytest.raises(Exception) as caught:  # the type is asserted by callers
        for batch in loader:
            if consume is not None:
                consume(batch)
    return caught.value, time.monotonic() - started


def worker_pid(error: Exception) -> int:
    found = re.search(r"loader worker (\d) \(pid (\d+)\)", str(error))
    assert found, f"no worker named in: {error}"
    return int(found.group(2))


# --- a worker that dies -----------------------------------------------------------------


def test_killed_worker_is_named_within_seconds_and_no_worker_survives(tmp_path: Path) -> None:
    loader = build_loader(Faulty("kill", pid_dir=str(tmp_path)), batch_size=4, num_workers=WORKERS)
    error, elapsed = fail_loading(loader)
    assert type(error) is DataError
    assert elapsed < 20
    message = str(error)
    assert "was killed by signal SIGKILL" in message
    assert "out-of-memory killer" in message and "dmesg" in error.hint
    assert "loader.num_workers" in error.hint
    assert worker_pid(error) in _pids(tmp_path)
    assert_no_workers_left(tmp_path)


def test_worker_killed_while_the_step_computes_is_named(tmp_path: Path) -> None:
    """SIGKILL from outside, between batches: the error comes during the step, not later."""
    loader = build_loader(Faulty("none", pid_dir=str(tmp_path)), batch_size=4, num_workers=WORKERS)
    killed: list[int] = []

    def step(batch: Any) -> None:
        if not killed:
            killed.append(min(_pids(tmp_path)))
            os.kill(killed[0], 9)
        time.sleep(0.5)  # a training step; SIGCHLD arrives during it

    error, elapsed = fail_loading(loader, consume=step)
    assert type(error) is DataError and elapsed < 20
    assert f"(pid {killed[0]}) was killed by signal SIGKILL" in str(error)
    assert_no_workers_left(tmp_path)


def test_worker_that_exits_is_named_with_its_exit_code(tmp_path: Path) -> None:
    loader = build_loader(Faulty("exit", pid_dir=str(tmp_path)), batch_size=4, num_workers=2)
    error, elapsed = fail_loading(loader)
    assert type(error) is DataError and elapsed < 20
    assert re.search(r"loader worker \d \(pid \d+\) exited with code 3", str(error))
    assert "loader.num_workers=0" in error.hint
    assert_no_workers_left(tmp_path)


# --- a worker that hangs ----------------------------------------------------------------


def test_default_timeout_is_finite() -> None:
    assert LoaderConfig().timeout_s == 300
    loader = build_loader(Faulty("none"), batch_size=4, num_workers=WORKERS)
    assert loader.timeout_s == 300
    # PyTorch's own timeout is the watch's poll, so dead workers are found every second.
    assert 0 < loader.dataloader.timeout <= 1


def test_hung_worker_times_out_showing_its_stack(tmp_path: Path) -> None:
    loader = build_loader(
        Faulty("hang", pid_dir=str(tmp_path)), batch_size=4, num_workers=WORKERS, timeout_s=1.5
    )
    error, elapsed = fail_loading(loader)
    assert type(error) is DataError
    assert 1.5 <= elapsed < 12
    message = str(error)
    assert worker_pid(error) in _pids(tmp_path)
    assert "did not deliver a batch for 1.5 s (loader.timeout_s)" in message
    # The stack names the line that blocks, in the dataset's own file.
    assert re.search(r'File "[^"]*loader_datasets\.py", line \d+, in _fail', message)
    assert "time.sleep" not in message or "loader_datasets.py" in message
    assert "loader.timeout_s" in error.hint
    assert_no_workers_left(tmp_path)


def test_lost_batch_is_reported_as_an_idle_worker(tmp_path: Path) -> None:
    """A batch that cannot be pickled never arrives; PyTorch alone would wait forever."""
    loader = build_loader(
        FaultyBatches("unpicklable", pid_dir=str(tmp_path)),
        batch_size=4,
        num_workers=WORKERS,
        timeout_s=1.5,
    )
    error, elapsed = fail_loading(loader)
    assert type(error) is DataError and elapsed < 12
    assert "yet it is idle" in str(error) and "cannot be pickled" in str(error)
    assert_no_workers_left(tmp_path)


# --- an exception in the dataset ----------------------------------------------------------


@pytest.mark.parametrize(("workers", "persistent"), [(0, False), (WORKERS, False), (WORKERS, True)])
def test_dataset_exception_names_sample_source_and_line(
    tmp_path: Path, workers: int, persistent: bool
) -> None:
    loader = build_loader(
        Faulty("raise", pid_dir=str(tmp_path)),
        batch_size=4,
        num_workers=workers,
        persistent_workers=persistent,
    )
    error, elapsed = fail_loading(loader)
    assert type(error) is SampleError and elapsed < 20
    where = "the training process" if workers == 0 else r"loader worker \d"
    assert re.match(
        rf"sample 13 of Faulty \(records/train\.bin\) failed in {where}: "
        r"ValueError: record 13 is corrupt \(raised at .*loader_datasets\.py:\d+, in _fail\)",
        error.message,
    ), error.message
    # The original is chained: the exception itself, or the worker's traceback naming it.
    if workers:
        assert "ValueError: record 13 is corrupt" in str(error.__cause__)
        assert "loader.num_workers=0" in error.hint
        assert_no_workers_left(tmp_path)
    else:
        assert isinstance(error.__cause__, ValueError)


@pytest.mark.parametrize("workers", [0, WORKERS])
def test_batched_fetch_exception_names_the_batch(tmp_path: Path, workers: int) -> None:
    loader = build_loader(
        FaultyBatches("raise", pid_dir=str(tmp_path)), batch_size=4, num_workers=workers
    )
    error, _ = fail_loading(loader)
    assert type(error) is SampleError
    assert error.message.startswith(
        "the batch of 4 samples [12, 13, 14, 15] of FaultyBatches (records/train.bin) failed"
    )
    assert "ValueError: record 13 is corrupt" in error.message
    if workers:
        assert_no_workers_left(tmp_path)


def test_bad_record_keeps_its_type_and_names_the_worker(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n[1, 2]\n' * 2)
    loader = build_loader(JsonlDataset(path), batch_size=2, num_workers=WORKERS)
    error, _ = fail_loading(loader)
    assert isinstance(error, BadRecordError)
    assert re.search(
        r"data\.jsonl, line 3: expected a JSON object.* \(in loader worker \d\)$", error.message
    ), error.message
    assert "data.bad_records=skip" in error.hint


# --- shared memory ---------------------------------------------------------------------


SHM_FIXES = ("--shm-size", "--ipc=host", "loader.num_workers", "loader.prefetch_factor")


def test_worker_killed_by_sigbus_says_shared_memory_is_short(tmp_path: Path) -> None:
    loader = build_loader(Faulty("bus", pid_dir=str(tmp_path)), batch_size=4, num_workers=2)
    error, elapsed = fail_loading(loader)
    assert type(error) is DataError and elapsed < 20
    message = str(error)
    assert re.search(r"loader worker \d \(pid \d+\) was killed by signal SIGBUS", message)
    assert "/dev/shm is too small" in message
    if os.path.exists("/dev/shm"):
        assert re.search(r"/dev/shm: [\d.]+ [MG]iB, [\d.]+ [MG]iB free", message)
    assert all(fix in error.hint for fix in SHM_FIXES)
    # faulthandler wrote where the worker was when the signal hit.
    assert re.search(r'File "[^"]*loader_datasets\.py", line \d+, in _fail', message)
    assert_no_workers_left(tmp_path)


@pytest.mark.parametrize(
    ("torch_message", "expected", "fixes"),
    [
        (
            "unable to write to file </torch_4242_1804289383_0>: No space left on device (28)",
            r"loader worker \d could not put a batch in shared memory: /dev/shm is too small",
            SHM_FIXES,
        ),
        (
            "unable to allocate shared memory(shm) for file </torch_4242_846930886_1>: Success (0)",
            r"loader worker \d could not put a batch in shared memory: /dev/shm is too small",
            SHM_FIXES,
        ),
        (
            "received 0 items of ancdata",
            r"from loader worker \d failed: the training process ran out of file descriptors",
            ("ulimit -n", "set_sharing_strategy('file_system')"),
        ),
    ],
)
def test_shared_memory_errors_say_how_to_fix_them(
    tmp_path: Path, torch_message: str, expected: str, fixes: tuple[str, ...]
) -> None:
    loader = build_loader(
        Faulty("none", pid_dir=str(tmp_path)),
        batch_size=4,
        num_workers=WORKERS,
        collate_fn=RaisingCollate(torch_message),
    )
    error, _ = fail_loading(loader)
    assert type(error) is DataError
    assert re.search(expected, str(error)), str(error)
    assert all(fix in error.hint for fix in fixes), error.hint
    assert_no_workers_left(tmp_path)


# --- from the command line ------------------------------------------------------------------


@pytest.mark.parametrize("debug", [False, True])
def test_cli_prints_one_error_line_and_the_traceback_only_with_debug(
    tmp_path: Path, debug: bool
) -> None:
    helpers = HERE / "loader_datasets.py"
    config = {
        "name": "killed-worker",
        "seed": 0,
        "model": {"name": f"{helpers}:tiny_model"},
        "data": {"train": {"name": f"{helpers}:faulty", "args": {"fault": "kill", "at": 20}}},
        "loader": {"batch_size": 4, "num_workers": WORKERS},
        "loss": {"name": "cross_entropy"},
        "train": {"epochs": 1, "device": "cpu"},
        "tracking": {"run_dir": str(tmp_path / "run")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    started = time.monotonic()
    if debug:  # a real process, as a user runs it
        done = subprocess.run(
            [sys.executable, "-m", "stoker.cli.main", "train", str(path), "--quiet", "--debug"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    else:  # the same main in this process: no interpreter and torch start (~4 s of CPU)
        done = run_cli("train", path, "--quiet", cwd=tmp_path, threads=1)
    assert done.returncode != 0 and time.monotonic() - started < 60
    assert re.search(r"loader worker \d \(pid \d+\) was killed by signal SIGKILL", done.stderr)
    if debug:
        assert "Traceback" in done.stderr
    else:
        assert "Traceback" not in done.stderr, done.stderr
        assert done.returncode == 1
        errors = [line for line in done.stderr.splitlines() if line.startswith("stoker: error:")]
        assert len(errors) == 1, done.stderr
