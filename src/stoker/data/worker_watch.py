"""Watching a loader's worker processes: dead, hung and failing workers found and shut down.

:class:`WorkerWatch` runs each pass of a multi-worker DataLoader. PyTorch's own
``timeout`` is set short (:func:`poll_interval`), so the watch regains control every
second while it waits for a batch: PyTorch checks for dead workers at each such poll, and
the watch raises once ``loader.timeout_s`` has passed. :class:`WorkerInit` has
:mod:`faulthandler` in every worker write its stack to a file, on SIGUSR1 (a late worker)
and on a fatal signal (a crash). PyTorch's SIGCHLD handler, which raises a RuntimeError
wherever the training process is when a worker dies, is wrapped to raise the DataError
instead. Each fault shuts the workers down before the error propagates, so none outlives
it. The messages themselves are :mod:`stoker.data.worker_faults`'.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import re
import shutil
import signal
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_for_exit
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from stoker.data.worker_faults import (
    TIMED_OUT,
    death_error,
    hang_error,
    is_transport_error,
    worker_error,
)
from stoker.data.worker_stop import quiet_pids as _quiet_pids
from stoker.data.worker_stop import release_workers, stop_workers_with
from stoker.errors import DataError

__all__ = ["DEFAULT_TIMEOUT_S", "WorkerInit", "WorkerWatch", "poll_interval"]

#: loader.timeout_s by default: far above any sane batch, far short of a job's lifetime.
DEFAULT_TIMEOUT_S = 300.0
# PyTorch's own timeout while waiting for a batch. Each time it expires PyTorch checks its
# workers, so this bounds how late an exit with code 0 is noticed (a signal or a nonzero
# code is noticed at once, through SIGCHLD).
_POLL_S = 1.0
_STACK_WAIT_S = 2.0  # for faulthandler to write a stack after SIGUSR1
_EXIT_WAIT_S = 2.0  # for a worker to be seen dead after its connection broke
_PID = re.compile(r"pid (\d+)")


def poll_interval(timeout_s: float) -> float:
    """The DataLoader ``timeout`` with which :class:`WorkerWatch` enforces ``timeout_s``."""
    return min(_POLL_S, timeout_s) if timeout_s > 0 else _POLL_S


# --- each worker's stack, on request and on a crash ------------------------------------

_WORKER_STACK_FILE: list[Any] = []  # keeps the worker's stack file open while it lives


def _stack_path(directory: str, worker_id: int) -> Path:
    return Path(directory, f"worker-{worker_id}.txt")


#: The signals a scheduler or a terminal sends a whole process group to stop a job.
STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP") if hasattr(signal, name)
)


def ignore_stop_signals() -> None:
    """Make this (worker) process ignore SIGTERM, SIGINT and SIGHUP.

    systemd, Slurm and Kubernetes stop a job by signalling its whole process group, so
    the loader workers get the SIGTERM the training process gets. A worker that died of
    it took the batches in flight with it and failed the stop-checkpoint. Ignored here,
    the training process alone decides: it saves the checkpoint after the current step,
    then shuts the workers down as at any loader's end (and they exit on their own when
    it dies, as PyTorch's workers watch their parent). A worker that will not stop is
    ended with SIGKILL (``WorkerWatch``), which cannot be ignored.
    """
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):  # forked blocked (stop_signals_blocked): ignored now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Hold the stop signals back in this thread while it forks loader workers.

    A worker ignores them only once its init has run: a group SIGTERM in its first
    moments would kill it and fail the stop-checkpoint. Forked with the signals blocked,
    a worker starts with them blocked (the mask is inherited) until ``ignore_stop_signals``
    ignores them; the training process gets any that came in once the block ends.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class WorkerInit:
    """A worker's first act: ignore stop signals, have :mod:`faulthandler` write its stack.

    On SIGUSR1 (sent when the worker is late past ``loader.timeout_s``) and on a fatal
    signal (SIGSEGV, SIGBUS, SIGABRT...) the stack of every thread is appended to
    ``<directory>/worker-<id>.txt``, where the training process reads it. It is
    signal-safe and works while the worker is blocked in C code; no ptrace, no extra tool.
    """

    def __init__(self) -> None:
        #: Set by :class:`WorkerWatch` before workers start; None turns this off.
        self.directory: str | None = None

    def __call__(self, worker_id: int) -> None:
        """Run first in loader worker ``worker_id``: stack dumps on, stop signals ignored."""
        # What the worker inherited is the training process's: its garbage collector must
        # not finalize it. A forked copy of another loader's iterator, garbage in a cycle,
        # ran PyTorch's shutdown here, on that loader's queues, from the wrong process.
        gc.freeze()
        if self.directory is not None:
            self._write_stacks_on_fault(worker_id)
        # Last: PyTorch's worker handlers (set again above) include one for SIGTERM that
        # ends the worker unless its parent sent it.
        ignore_stop_signals()

    def _write_stacks_on_fault(self, worker_id: int) -> None:
        assert self.directory is not None
        # Append mode: the reader knows where a new dump starts (the size before it).
        stream = _stack_path(self.directory, worker_id).open("a")
        _WORKER_STACK_FILE[:] = [stream]
        # A parent's faulthandler (pytest enables one) is inherited as "enabled", though
        # PyTorch has since put its own handlers in place; enable() would then keep
        # PyTorch's. Start over: PyTorch's handlers, with faulthandler's in front of them.
        faulthandler.disable()
        _set_torch_worker_handlers()
        faulthandler.enable(file=stream, all_threads=True)
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=stream, all_threads=True)

    def __repr__(self) -> str:
        return f"WorkerInit(directory={self.directory!r})"


def _set_torch_worker_handlers() -> None:
    """PyTorch's worker handlers for SIGBUS, SIGSEGV and SIGFPE (they print a hint on stderr)."""
    try:
        from torch.utils.data._utils.signal_handling import _set_worker_signal_handlers
    except ImportError:  # a PyTorch that moved it: faulthandler alone still writes the stack
        return
    _set_worker_signal_handlers()


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with path.open("rb") as stream:
            stream.seek(offset)
            return stream.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _dead(workers: list[Any], *, wait_s: float) -> list[tuple[int, int | None, int]]:
    """``(worker id, pid, exit code)`` of the workers that ended, waiting up to ``wait_s``.

    A worker killed mid-send breaks the connection before it is seen dead: its sentinel
    becomes ready as it closes its files, a moment before the kernel lets it be reaped.
    """
    deadline = time.monotonic() + wait_s
    while True:
        dead = [(i, w.pid, w.exitcode) for i, w in enumerate(workers) if w.exitcode is not None]
        left = deadline - time.monotonic()
        if dead or left <= 0 or not workers:
            return dead
        if wait_for_exit([w.sentinel for w in workers], timeout=left):
            time.sleep(0.005)  # it has exited, but is not yet reapable


# --- the watch over one loader's workers -------------------------------------------------

_WATCHES: weakref.WeakSet[WorkerWatch] = weakref.WeakSet()
_sigchld_wrapped = False


class WorkerWatch:
    """Runs the passes of a multi-worker DataLoader and reports its faults as DataErrors.

    Args:
        dataloader: The DataLoader (``num_workers > 0``); its ``timeout`` is the poll
            interval (:func:`poll_interval`), its ``worker_init_fn`` a :class:`WorkerInit`
            for stacks (without one, a hung worker is reported without its stack).
        timeout_s: A worker that delivers no batch for this long is an error; 0: wait forever.
        dataset: The dataset as the user wrote it, for messages.
    """

    def __init__(self, dataloader: DataLoader, *, timeout_s: float, dataset: Any) -> None:
        self.dataloader = dataloader
        self.timeout_s = float(timeout_s)
        self.dataset = dataset
        init = dataloader.worker_init_fn
        self._init = init if isinstance(init, WorkerInit) else None
        # Weak: a pass left early must not keep its workers alive through the watch.
        self._iterator: Callable[[], Any] = lambda: None
        self._in_next = False
        self._offsets: dict[int, int] = {}
        _WATCHES.add(self)

    def batches(self) -> Iterator[Any]:
        """One pass of the DataLoader; a fault shuts its workers down and raises a DataError."""
        directory = self._stack_directory()
        if directory is not None:
            workers = range(self.dataloader.num_workers)
            self._offsets = {i: _file_size(_stack_path(directory, i)) for i in workers}
        with stop_signals_blocked():  # the workers fork here (the first pass, or each one)
            iterator = iter(self.dataloader)
        self._iterator = weakref.ref(iterator)
        stop_workers_with(iterator)
        _quiet_pids.difference_update(w.pid for w in getattr(iterator, "_workers", ()))
        _wrap_sigchld_handler()
        waiting_since = time.monotonic()
        while True:
            self._in_next = True
            try:
                batch = next(iterator)
            except StopIteration:
                return
            except Exception as error:
                if TIMED_OUT in str(error) and not self._overdue(waiting_since):
                    continue  # a poll: PyTorch has checked its workers; keep waiting
                fault = self._fault(error, iterator)
                if fault is error:
                    raise
                raise fault from error
            finally:
                self._in_next = False
            try:
                yield batch
            except GeneratorExit:
                # The pass is left early: workers that are not kept for the next pass
                # stop now, before PyTorch's shutdown joins each one for up to 5 s.
                if not self.dataloader.persistent_workers:
                    release_workers(iterator)
                raise
            waiting_since = time.monotonic()

    def _overdue(self, since: float) -> bool:
        return self.timeout_s > 0 and time.monotonic() - since >= self.timeout_s

    def _stack_directory(self) -> str | None:
        if self._init is None:
            return None
        if self._init.directory is None:
            directory = tempfile.mkdtemp(prefix="stoker-loader-stacks-")
            weakref.finalize(self, shutil.rmtree, directory, ignore_errors=True)
            self._init.directory = directory  # forked (or pickled) into each worker
        return self._init.directory

    def _fault(self, error: Exception, iterator: Any) -> BaseException:
        """The error to raise for ``error`` (``error`` itself when it is no worker fault)."""
        try:
            workers = list(getattr(iterator, "_workers", ()))
            dead = _dead(workers, wait_s=_EXIT_WAIT_S if is_transport_error(error) else 0.0)
            if dead:
                return self.death_error(dead)
            if TIMED_OUT in str(error):
                return self._hang_error(iterator, workers)
            return worker_error(error, self.dataset)
        finally:
            self.release(iterator)

    def death_error(self, dead: list[tuple[int, int | None, int]]) -> DataError:
        """The error for workers that ended: ``(worker id, pid, exit code)`` each."""
        worker_id = dead[0][0]
        directory = self._init.directory if self._init else None
        dump = ""
        if directory is not None:
            dump = _read_from(_stack_path(directory, worker_id), self._offsets.get(worker_id, 0))
        return death_error(dead, dump)

    def _hang_error(self, iterator: Any, workers: list[Any]) -> DataError:
        # The batch the loader waits for went to one worker: that one is late.
        info = getattr(iterator, "_task_info", {}).get(getattr(iterator, "_rcvd_idx", -1))
        worker_id = info[0] if info and info[0] < len(workers) else None
        who, dump = None, ""
        if worker_id is not None:
            pid = workers[worker_id].pid
            who, dump = (
                f"loader worker {worker_id} (pid {pid})",
                self._request_stack(worker_id, pid),
            )
        # End them now: shutting down would wait 5 s for each worker that does not answer.
        _quiet_pids.update(w.pid for w in workers)
        for process in workers:
            if process.is_alive():
                process.kill()
        return hang_error(who, timeout_s=self.timeout_s, dump=dump)

    def _request_stack(self, worker_id: int, pid: int | None) -> str:
        """Ask the worker's faulthandler for its stack (SIGUSR1) and read what it writes."""
        directory = self._init.directory if self._init else None
        if directory is None or pid is None or not hasattr(signal, "SIGUSR1"):
            return ""
        path = _stack_path(directory, worker_id)
        start = size = _file_size(path)
        try:
            os.kill(pid, signal.SIGUSR1)
        except OSError:
            return ""
        deadline = time.monotonic() + _STACK_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.02)
            now = _file_size(path)
            if now > start and now == size:
                break  # written, and no longer growing
            size = now
        return _read_from(path, start)

    def release(self, iterator: Any = None) -> None:
        """Shut the workers down now: the error may live long (in a traceback), they must not."""
        iterator = self._iterator() if iterator is None else iterator
        if iterator is None:
            return
        # The ends that shutting down brings (or that were reported) raise nothing more.
        _quiet_pids.update(w.pid for w in getattr(iterator, "_workers", ()))
        release_workers(iterator)  # stopped, or killed after _STOP_WAIT_S
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        if getattr(self.dataloader, "_iterator", None) is iterator:
            self.dataloader._iterator = None  # a later pass starts fresh workers

    def worker_of(self, pid: int) -> int | None:
        """The id of this loader's current worker with ``pid``, or None."""
        for worker_id, process in enumerate(getattr(self._iterator(), "_workers", ())):
            if process.pid == pid:
                return worker_id
        return None


# --- a worker that dies while the training process computes ---------------------------


def _exit_status(pid: int) -> int | None:
    """A dead child's exit code (negative: the signal), read without reaping it."""
    try:
        result = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (OSError, AttributeError):
        return None
    if result is None:
        return None
    return result.si_status if result.si_code == os.CLD_EXITED else -result.si_status


def _worker_died(pid: int) -> DataError | None:
    """The error for a dead worker ``pid`` of a watched loader (None: not one of ours)."""
    code = _exit_status(pid)
    for watch in list(_WATCHES):
        worker_id = watch.worker_of(pid)
        if worker_id is None or code is None:
            continue
        error = watch.death_error([(worker_id, pid, code)])
        if not watch._in_next:
            # The training step runs, no code of the DataLoader's iterator does: shut the
            # workers down here. Inside the loader, the watch does it as it reports.
            with contextlib.suppress(Exception):
                watch.release()
        return error
    return None


def _wrap_sigchld_handler() -> None:
    """Make PyTorch's SIGCHLD handler raise a DataError naming the worker, not a RuntimeError.

    PyTorch raises "DataLoader worker (pid 123) is killed by signal: Killed." from its
    SIGCHLD handler, wherever the training process is at that moment (often mid-step,
    outside the loader). Wrapped, the same moment raises :meth:`WorkerWatch.death_error`'s
    DataError; the ends of workers a watch shut down itself raise nothing. Set once per
    process, from the main thread, after PyTorch has set its handler (with the first
    multi-worker iterator).
    """
    global _sigchld_wrapped
    if _sigchld_wrapped or not hasattr(signal, "SIGCHLD"):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    torch_handler = signal.getsignal(signal.SIGCHLD)
    if not callable(torch_handler):
        return

    def handler(signum: int, frame: Any) -> None:
        try:
            torch_handler(signum, frame)
        except RuntimeError as error:
            found = _PID.search(str(error))
            pid = int(found.group(1)) if found else -1
            if pid in _quiet_pids:
                return
            fault = _worker_died(pid)
            if fault is None:
                raise
            raise fault from error

    signal.signal(signal.SIGCHLD, handler)
    _sigchld_wrapped = True
