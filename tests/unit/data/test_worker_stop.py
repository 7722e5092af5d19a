"""A loader's workers stop however its iterator ends: collected in a cycle, stuck, at exit."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from stoker.data import worker_stop
from stoker.data.loader import build_loader

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="forked workers")


class _Numbers(Dataset):
    """Per-sample reads (so the loader uses its workers); index >= ``stuck_from`` never returns."""

    def __init__(self, n: int, stuck_from: int | None = None, mark: str = "") -> None:
        self.n, self.stuck_from, self.mark = n, stuck_from, mark

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if self.stuck_from is not None and index >= self.stuck_from:
            open(self.mark, "w").close()  # the test waits for it
            time.sleep(600)  # a worker stuck in user code
        return torch.tensor([float(index)])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _worker_pids(loader: Any) -> list[int]:
    iterator = loader._watch._iterator()  # the pass's DataLoader iterator
    return [w.pid for w in iterator._workers]


def test_a_loader_collected_in_a_reference_cycle_stops_its_workers_at_once() -> None:
    loader = build_loader(_Numbers(64), batch_size=16, num_workers=2, persistent_workers=True)
    assert sum(len(b) for b in loader) == 64
    pids = _worker_pids(loader)
    loader.me = loader  # a cycle: only the garbage collector frees it
    del loader
    started = time.perf_counter()
    gc.collect()
    took = time.perf_counter() - started
    # Before: the index queues were closed first, the workers never got their stop
    # message, and PyTorch's shutdown waited 5 s per worker (10 s here).
    assert took < 3.0, f"collecting the loader took {took:.1f} s"
    assert not any(_alive(pid) for pid in pids)


def test_a_worker_stuck_in_user_code_is_killed_when_its_loader_goes(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(worker_stop, "_STOP_WAIT_S", 0.3)
    mark = tmp_path / "stuck"
    data = _Numbers(64, stuck_from=8, mark=str(mark))
    loader = build_loader(data, batch_size=8, num_workers=1)
    batches = iter(loader)
    next(batches)
    deadline = time.monotonic() + 10
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker is now stuck in its next batch
    (pid,) = _worker_pids(loader)
    started = time.perf_counter()
    batches.close()  # the pass is left early; its iterator goes
    del batches
    gc.collect()
    took = time.perf_counter() - started
    assert took < 2.5, f"stopping the loader took {took:.1f} s"
    assert not _alive(pid), "the stuck worker outlived its loader"


@pytest.mark.slow  # a fresh interpreter importing torch: 3-6 s
def test_a_process_exits_while_a_loader_still_has_workers(tmp_path) -> None:
    # multiprocessing ends a process by SIGTERM to its daemon children (which stoker's
    # workers ignore) and then joins them: without stopping them first, it never exits.
    script = tmp_path / "exit.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(os.path.dirname(__file__))!r})
            from test_worker_stop import _Numbers
            from stoker.data.loader import build_loader
            LOADER = build_loader(_Numbers(64), batch_size=8, num_workers=2,
                                  persistent_workers=True)
            BATCHES = iter(LOADER)
            next(BATCHES)
            print("exiting", flush=True)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting" in done.stdout


class _Finalized:
    """Garbage in a reference cycle that records which process finalizes it."""

    def __init__(self, path: str) -> None:
        self.path, self.me = path, self

    def __del__(self) -> None:
        with open(self.path, "a") as stream:
            stream.write(f"{os.getpid()}\n")


class _Collecting(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> torch.Tensor:
        gc.collect()  # as any allocation-heavy sample may trigger
        return torch.tensor([float(index)])


def test_a_worker_does_not_finalize_what_it_inherited(tmp_path) -> None:
    path = str(tmp_path / "finalized")
    gc.disable()  # the cycle is still uncollected garbage when the worker forks
    try:
        _Finalized(path)
        loader = build_loader(_Collecting(), batch_size=4, num_workers=1)
        assert sum(len(b) for b in loader) == 8
    finally:
        gc.enable()
    gc.collect()
    pids = Path(path).read_text().split() if os.path.exists(path) else []
    # Before: the worker's collector ran __del__ too (PyTorch's shutdown of another
    # loader, in the suite), from the worker's process.
    assert pids == [str(os.getpid())]


def test_close_stops_a_loaders_persistent_workers_now() -> None:
    loader = build_loader(_Numbers(64), batch_size=16, num_workers=2, persistent_workers=True)
    assert sum(len(b) for b in loader) == 64
    pids = _worker_pids(loader)
    assert all(_alive(pid) for pid in pids)  # persistent: alive between passes
    loader.close()
    assert not any(_alive(pid) for pid in pids)
    # A later pass starts fresh workers and reads every sample again.
    assert sum(len(b) for b in loader) == 64
    assert set(_worker_pids(loader)).isdisjoint(pids)
    loader.close()


class _PidNoting(Dataset):
    """Per-sample reads that leave one empty file per reading process, named by its pid."""

    def __init__(self, n: int, folder: Path) -> None:
        self.n, self.folder = n, folder

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        (self.folder / str(os.getpid())).touch()
        return torch.full((4,), float(index % 3)), index % 3


def test_a_runs_persistent_workers_end_with_the_run(tmp_path: Path) -> None:
    import stoker

    pids_dir = tmp_path / "pids"
    pids_dir.mkdir()
    data = _PidNoting(96, pids_dir)
    # With the collector off, only the run itself can end its workers: the loader sits in
    # reference cycles (loop, callbacks), which kept its persistent workers alive after fit.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        stoker.fit(
            torch.nn.Linear(4, 3), data, data, epochs=2, batch_size=16, num_workers=2,
            persistent_workers=True, run_dir=tmp_path / "run", progress="quiet",
            tensorboard=False, fingerprint="off",
        )  # fmt: skip
        workers = [int(p.name) for p in pids_dir.iterdir() if int(p.name) != os.getpid()]
        assert len(workers) >= 2, workers  # train's and val's workers read the samples
        alive = [pid for pid in workers if _alive(pid)]
    finally:
        if was_enabled:
            gc.enable()
    assert alive == [], f"workers {alive} outlived the run"
