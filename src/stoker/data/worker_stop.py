"""Stopping a DataLoader's worker processes, whichever way its iterator ends.

Released by the training process, collected by the garbage collector (also in a reference
cycle) or left alive at interpreter exit, an iterator's workers are told to stop and, when
they do not within ``_STOP_WAIT_S``, killed: stoker's workers ignore SIGTERM (see
:func:`stoker.data.worker_watch.ignore_stop_signals`), PyTorch's last resort.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
import weakref
from multiprocessing.connection import wait as wait_for_exit
from typing import Any

__all__ = ["quiet_pids", "release_workers", "stop_workers_with"]

# For workers told to stop to exit, before SIGKILL ends the rest (their stop signals are
# ignored, so PyTorch's SIGTERM after its 5 s join per worker would not end them).
_STOP_WAIT_S = 3.0

#: Workers whose end needs no (further) error: reported already, or stopped on purpose.
quiet_pids: set[int] = set()


class _Crew:
    """What stops one DataLoader iterator's workers, held apart from the iterator itself.

    PyTorch stops the workers in the iterator's ``__del__``: it sets their done event and
    puts ``None`` in each index queue. When the iterator dies in a reference cycle, the
    garbage collector first runs the weakref callbacks of everything in the cycle, and
    ``multiprocessing`` closes each index queue's feeder thread in one of those; the
    ``None`` put after it is never sent, each worker waits for it, PyTorch joins 5 s per
    worker and then sends SIGTERM, which stoker's workers ignore (measured: 20 s for 4
    workers, and the workers outlive the loader). Holding the queues here keeps them out
    of the cycle: they are still open when :meth:`stop` runs, before ``__del__``.
    """

    def __init__(self, iterator: Any) -> None:
        self.owner = os.getpid()  # a forked copy of this object in a worker is not its owner
        self.workers = list(getattr(iterator, "_workers", ()))
        self.queues = list(getattr(iterator, "_index_queues", ()))
        self.done = getattr(iterator, "_workers_done_event", None)

    def stop(self) -> None:
        """Tell the workers to stop, wait up to ``_STOP_WAIT_S`` for them, SIGKILL the rest."""
        if os.getpid() != self.owner:
            return
        alive = [w for w in self.workers if w.exitcode is None]
        if not alive:
            return
        quiet_pids.update(w.pid for w in self.workers)  # their ends are no fault
        if self.done is not None:
            self.done.set()
        for index_queue in self.queues:
            with contextlib.suppress(Exception):  # closed already: that worker has stopped
                index_queue.put(None)
        deadline = time.monotonic() + _STOP_WAIT_S
        while alive and (left := deadline - time.monotonic()) > 0:
            wait_for_exit([w.sentinel for w in alive], timeout=left)
            alive = [w for w in alive if w.exitcode is None]
        for process in alive:  # stuck in user code, or never given the None
            process.kill()
            process.join(timeout=1.0)


_CREWS: dict[int, weakref.finalize] = {}


def stop_workers_with(iterator: Any) -> None:
    """Have ``iterator``'s workers stopped when it is released or collected (once each)."""
    key = id(iterator)
    if key in _CREWS and _CREWS[key].alive:
        return  # a persistent-worker iterator, seen on an earlier pass
    crew = _Crew(iterator)
    if not crew.workers:
        return
    finalizer = weakref.finalize(iterator, _stop_crew, key, crew)
    finalizer.atexit = False  # _stop_all_crews, before multiprocessing's exit join
    _CREWS[key] = finalizer


def _stop_crew(key: int, crew: _Crew) -> None:
    _CREWS.pop(key, None)
    crew.stop()


def release_workers(iterator: Any) -> None:
    """Stop ``iterator``'s workers now (no-op when they are stopped or were never seen)."""
    finalizer = _CREWS.get(id(iterator))
    if finalizer is not None:
        finalizer()


@atexit.register  # after multiprocessing's handler, so it runs first (atexit is LIFO)
def _stop_all_crews() -> None:
    """At exit, stop the workers of loaders still alive: multiprocessing would SIGTERM
    them (ignored) and then join them forever."""
    for finalizer in list(_CREWS.values()):
        with contextlib.suppress(Exception):
            finalizer()
