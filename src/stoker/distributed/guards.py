"""Guardrails that turn the ways a distributed run hangs into errors that name the rank.

A DDP job hangs when one rank waits in a collective that another never reaches: it ran
out of batches, it is stuck in user code, it died, or it stopped on a signal the others
did not get. Before every micro-batch the ranks agree, on the CPU, whether each has a
batch and whether any was asked to stop; a rank with no progress for the collective
timeout prints its stack and exits; a collective that fails is explained by asking the
store which ranks are still there.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from stoker.distributed.runtime import Distributed
from stoker.errors import DataError, TrainingError
from stoker.observe.timing import PhaseTimer
from stoker.train.loop import StopRequest


class AgreedStop(StopRequest):
    """A stop request that every rank acts on at the same step.

    The signal handler sets ``signal_name`` on the rank that got the signal;
    ``requested`` is what the ranks agreed at the last micro-batch fetch, so no rank
    saves a checkpoint (a collective) while another trains on.
    """

    def __init__(self) -> None:
        super().__init__()
        self.agreed = False

    @property
    def requested(self) -> bool:
        """True once the ranks agreed to stop, so that all stop after the same step."""
        return self.agreed

    @property
    def local(self) -> bool:
        """True when this rank itself received the stop signal."""
        return self.signal_name is not None


class RankSyncedLoader:
    """The training loader, with the ranks agreeing before each batch that all have one.

    Otherwise the same loader: ``set_epoch``, ``len`` and the resume state pass through.
    The time spent agreeing is reported to ``timer`` as communication, not data wait: a
    rank waiting there waits for a slower rank, not for its own data.
    """

    def __init__(
        self,
        loader: Any,
        dist: Distributed,
        *,
        stop: AgreedStop,
        watchdog: Watchdog,
        timer: PhaseTimer | None = None,
    ):
        self.loader = loader
        self.dist = dist
        self.stop = stop
        self.watchdog = watchdog
        self.timer = timer
        self.epoch = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Set the wrapped loader's epoch and check that every rank has as many batches."""
        self.epoch = epoch
        self.loader.set_epoch(epoch)
        check_equal_lengths(self.loader, self.dist, epoch=epoch)

    def __iter__(self) -> Iterator[Any]:
        delivered = 0
        batches = iter(self.loader)
        self.watchdog.arm(f"epoch {self.epoch + 1}, batch {delivered + 1}")
        try:
            while True:
                batch = next(batches, _END)
                has_batch = batch is not _END
                # Waiting here for a slower rank is the collective timeout's business.
                started = time.perf_counter()
                with (
                    self.watchdog.paused(),
                    explain_collective_failure(
                        self.dist, f"batch {delivered + 1} of epoch {self.epoch + 1}"
                    ),
                ):
                    ranks_with_batch, stopping = self.dist.control_sum(
                        [int(has_batch), int(self.stop.local)]
                    )
                if self.timer is not None:
                    self.timer.communication(time.perf_counter() - started)
                self.watchdog.tick(f"epoch {self.epoch + 1}, batch {delivered + 2}")
                if stopping:
                    self.stop.agreed = True
                if ranks_with_batch == 0:
                    return
                if ranks_with_batch < self.dist.world_size:
                    self._uneven(has_batch, delivered)
                delivered += 1
                yield batch
        finally:
            self.watchdog.disarm()

    def _uneven(self, has_batch: bool, delivered: int) -> None:
        counts = self.dist.all_gather(delivered + int(has_batch))
        short = [rank for rank, count in enumerate(counts) if count == delivered]
        raise DataError(
            f"uneven data across ranks in epoch {self.epoch + 1}: rank(s) "
            f"{', '.join(map(str, short))} ran out after {delivered} batches while the others "
            "have more; DDP would wait forever in the next gradient all-reduce",
            hint="give every rank the same number of batches: loader.drop_last=true, a "
            "map-style dataset (stoker pads ranks evenly), or ShardStream(uneven='pad'|'drop')",
        )


_END = object()


def check_equal_lengths(loader: Any, dist: Distributed, *, epoch: int) -> None:
    """Before an epoch: every rank expects the same number of batches (when it knows)."""
    if not dist.enabled:
        return
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    lengths = dist.all_gather(length)
    known = {n for n in lengths if n is not None}
    if len(known) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(lengths))
        raise DataError(
            f"the ranks would run different numbers of batches in epoch {epoch + 1} ({listing}); "
            "DDP would hang in the last all-reduce of the shorter ranks",
            hint="give every rank the same dataset and loader settings; stoker splits it evenly",
        )


def check_same_data(dist: Distributed, *, length: int | None, digest: str | None) -> None:
    """Every rank must hold the whole dataset: stoker splits it across ranks itself.

    Data that differs between ranks was most likely split already (by rank, in user
    code), and splitting it again would train each rank on 1/N² of it.
    """
    if not dist.enabled:
        return
    seen = dist.all_gather((length, digest))
    if len(set(seen)) == 1:
        return
    listing = "; ".join(
        f"rank {r}: {n if n is not None else 'unknown'} samples"
        + (f", fingerprint {d[:12]}" if d else "")
        for r, (n, d) in enumerate(seen)
    )
    raise DataError(
        f"the ranks hold different training data ({listing}). stoker gives each rank its "
        "share itself, so data already split by rank would be split twice (each rank "
        "seeing 1/N² of it)",
        hint="pass the whole dataset on every rank; drop your own DistributedSampler or "
        "per-rank slicing",
    )


class Watchdog:
    """Exits a rank that makes no progress for ``timeout_s``, printing its stack first.

    The other ranks learn of it from their collective timing out; this rank would
    otherwise hang for ever where it is stuck (user code, a dataset, I/O). It fires a
    little after the collective timeout, so that a rank merely waiting in a collective
    for a stuck one reports through the collective's error instead.
    """

    def __init__(self, dist: Distributed) -> None:
        self.dist = dist
        self.timeout_s = dist.timeout_s + 2 * explain_collective_failure.grace_s
        self._deadline: float | None = None
        self._where = ""
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def arm(self, where: str) -> None:
        """Start watching: a rank that makes no progress past the timeout exits with its stack."""
        if not self.dist.enabled:
            return
        self.tick(where)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="stoker-watchdog", daemon=True)
            self._thread.start()

    def tick(self, where: str) -> None:
        """Progress at ``where``: the deadline moves a timeout ahead."""
        if self.dist.enabled:
            with self._lock:
                self._deadline = time.monotonic() + self.timeout_s
                self._where = where

    def disarm(self) -> None:
        """No deadline until the next ``tick`` or ``arm``."""
        with self._lock:
            self._deadline = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No deadline while rank 0 writes a checkpoint (the others wait in a collective)."""
        with self._lock:
            deadline, self._deadline = self._deadline, None
        try:
            yield
        finally:
            with self._lock:
                if deadline is not None:
                    self._deadline = time.monotonic() + self.timeout_s

    def close(self) -> None:
        """Stop watching for good, and wait for the watching thread to end.

        The thread holds the process groups (through ``dist``): left running, they would
        still be alive while the interpreter exits, their native threads with them.
        """
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.timeout_s / 4)):
            with self._lock:
                deadline, where = self._deadline, self._where
            if deadline is not None and time.monotonic() > deadline:
                self._give_up(where)

    def _give_up(self, where: str) -> None:
        print(
            f"stoker: error: rank {self.dist.rank} made no progress for {self.timeout_s:g} s "
            f"(waiting for {where}); its stack follows, then it exits so the job does not hang",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(1)


class explain_collective_failure:
    """Turns a collective that failed or timed out into an error naming the missing ranks.

    Each rank that gets here writes its name into the store and waits briefly for the
    others; the ranks that never write are the ones that died or hang.
    """

    grace_s = 5.0

    def __init__(self, dist: Distributed, where: str) -> None:
        self.dist = dist
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, tb: Any) -> bool:
        if error is None or not self.dist.enabled or not _is_collective_failure(error):
            return False
        missing = missing_ranks(self.dist)
        who = (
            f"rank(s) {', '.join(map(str, missing))} did not answer"
            if missing
            else "a rank did not answer"
        )
        raise TrainingError(
            f"rank {self.dist.rank}: a collective at {self.where} failed: {who} "
            f"(died, or hung for over distributed.timeout_s={self.dist.timeout_s:g} s); "
            f"the collective said: {str(error).splitlines()[0][:200]}",
            hint="see that rank's own error above (its stack when it hung); "
            "rerun with --max-restarts K to restart the group from the last checkpoint",
        ) from error


#: What gloo, NCCL and c10d say when a peer is gone or a collective timed out.
_COLLECTIVE_SIGNS = ("gloo", "nccl", "connection reset", "connection closed", "timed out", "c10d")


def _is_collective_failure(error: BaseException) -> bool:
    import torch.distributed as torch_dist

    if isinstance(error, torch_dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(sign in text for sign in _COLLECTIVE_SIGNS)


def missing_ranks(dist: Distributed) -> list[int]:
    """The ranks that do not check in to the store within a short grace period.

    Every rank that meets a failed collective checks in, wherever it met it; a rank
    that died or hangs never does.
    """
    try:
        import torch.distributed as torch_dist

        store = torch_dist.PrefixStore(
            f"stoker/failure/{dist.info.restart_count}/",
            torch_dist.distributed_c10d._get_default_store(),
        )
        store.set(str(dist.rank), "here")
        deadline = time.monotonic() + explain_collective_failure.grace_s
        keys = [str(rank) for rank in range(dist.world_size)]
        while time.monotonic() < deadline:
            present = [rank for rank, key in enumerate(keys) if store.check([key])]
            if len(present) == dist.world_size:
                return []
            time.sleep(0.2)
        return [rank for rank, key in enumerate(keys) if not store.check([key])]
    except Exception:  # the store itself may be gone with rank 0; then we cannot tell
        return []
