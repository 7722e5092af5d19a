"""Streaming shards: one IterableDataset split over ranks and workers, evened out, resumable."""

from __future__ import annotations

import glob
import itertools
import json
import logging
import math
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from stoker.data.records import BadRecordPolicy, bad_record
from stoker.data.samplers import epoch_seed, rank_and_world_size
from stoker.errors import ConfigError, DataError

__all__ = ["ShardStream", "SplitMode", "UnevenPolicy"]

logger = logging.getLogger("stoker")

SplitMode = Literal["shard", "sample"]
UnevenPolicy = Literal["pad", "drop"]
ShardReader = Callable[[Path], Iterable[Any]]

# epoch_seed streams of one (seed, epoch): the shard order, and the shuffle buffers.
_SHARD_ORDER_STREAM = 4
_BUFFER_STREAM = 5


def _read_jsonl(path: Path, policy: BadRecordPolicy = "error") -> Iterator[Any]:
    """The JSON values of a JSON Lines file; a line that does not parse is a bad record.

    Under ``policy="skip"`` a :class:`~stoker.data.records.BadSample` takes its place, so
    the shard's sample count (and every position after it) stays what it was counted as.
    """
    with path.open("rb") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
                reason = error.msg if isinstance(error, json.JSONDecodeError) else str(error)
                value = bad_record(
                    policy,
                    source=str(path),
                    location=f"line {number}",
                    reason=f"not a JSON value ({reason}); write one JSON object per line",
                )
            yield value


def _count_jsonl(path: Path) -> int:
    with path.open("rb") as file:
        return sum(1 for line in file if line.strip())


def _read_npy(path: Path) -> Iterator[torch.Tensor]:
    rows = np.load(path, mmap_mode="r", allow_pickle=False)
    if rows.ndim == 0:
        raise DataError(f"{path} holds a scalar; expected an array with one row per sample.")
    for row in rows:
        # Copy the row out of the memory map: a view would keep the whole file mapped.
        yield torch.from_numpy(np.array(row))


def _count_npy(path: Path) -> int:
    return int(np.load(path, mmap_mode="r", allow_pickle=False).shape[0])


def _load_pt(path: Path) -> torch.Tensor | Sequence[Any]:
    data = torch.load(path, map_location="cpu", weights_only=True)
    if (isinstance(data, torch.Tensor) and data.dim() > 0) or isinstance(data, list | tuple):
        return data
    raise DataError(
        f"{path} holds a {type(data).__name__}; expected a list of samples or a tensor with "
        "one row per sample (saved with torch.save).",
        hint="torch.save(list_of_samples, path), or pass read_shard= to read this format",
    )


# Suffix -> (reader, counter); looked up at call time, never pickled.
_FORMATS: dict[str, tuple[ShardReader, Callable[[Path], int]]] = {
    ".jsonl": (_read_jsonl, _count_jsonl),
    ".npy": (_read_npy, _count_npy),
    ".pt": (_load_pt, lambda path: len(_load_pt(path))),
}


def _resolve_shards(shards: Sequence[str | Path] | str | Path) -> list[Path]:
    if isinstance(shards, str):
        paths = [Path(p) for p in sorted(glob.glob(shards, recursive=True))]
        if not paths:
            raise DataError(
                f"no shard files match {shards!r}.",
                hint="check the pattern, e.g. 'data/train-*.jsonl' (use ** to recurse)",
            )
        return paths
    paths = [Path(shards)] if isinstance(shards, Path) else [Path(p) for p in shards]
    if not paths:
        raise DataError("ShardStream got no shards.", hint="pass a glob string or a list of files")
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise DataError(
            f"{len(missing)} shard file(s) not found, first: {missing[0]}.",
            hint="check the paths, or pass a glob string such as 'data/*.jsonl'",
        )
    return paths


def _shuffled(samples: Iterable[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """A shuffle buffer of ``size``: each new sample takes the place of one drawn at random."""
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        i = rng.randrange(size)
        yield buffer[i]
        buffer[i] = sample
    rng.shuffle(buffer)
    yield from buffer


def _level(counts: list[int], total: int, *, down: bool) -> list[int]:
    """Water-fill ``counts`` to sum to ``total``: cut the largest (down) or raise the smallest.

    Raising touches only non-zero counts: an empty slot has nothing to repeat.
    """
    eligible = [down or c > 0 for c in counts]

    def filled(level: int) -> list[int]:
        pairs = zip(counts, eligible, strict=True)
        return [(min(c, level) if down else max(c, level)) if ok else c for c, ok in pairs]

    lo, hi = 0, max(counts) if down else total
    while lo < hi:
        if down:  # the lowest cap that still keeps `total`
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if sum(filled(mid)) >= total else (mid + 1, hi)
        else:  # the highest floor that stays within `total`
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if sum(filled(mid)) <= total else (lo, mid - 1)
    out = filled(lo)
    # What is left is smaller than the number of slots at the level: one more (or less) each.
    left = abs(sum(out) - total)
    for i, ok in enumerate(eligible):
        if left and ok and out[i] == lo:
            out[i] += -1 if down else 1
            left -= 1
    return out


def _even_out(natural: list[list[int]], uneven: UnevenPolicy, unit: int) -> list[list[int]]:
    """Per-(rank, worker) targets: every rank the same total, every slot whole ``unit``s."""
    if uneven == "drop":
        units = [[n // unit for n in rank] for rank in natural]
        total = min(sum(rank) for rank in units)
    else:
        units = [[math.ceil(n / unit) for n in rank] for rank in natural]
        total = max(sum(rank) for rank in units)
    if total == 0 and any(map(any, natural)):
        raise DataError(
            f"with uneven='drop' every rank would yield 0 samples (the smallest share has "
            f"no whole batch of {unit}).",
            hint="use uneven='pad', fewer ranks or workers, or a smaller batch_size",
        )
    targets = []
    for rank, counts in enumerate(units):
        if sum(counts) < total and not any(counts):
            raise DataError(
                f"rank {rank} has no samples to repeat, so uneven='pad' cannot match the "
                f"other ranks' {total * unit}.",
                hint="give the stream more shards or samples than ranks, or use uneven='drop'",
            )
        levelled = _level(counts, total, down=uneven == "drop")
        targets.append([u * unit for u in levelled])
    return targets


@dataclass(frozen=True)
class _Plan:
    """Who reads what in one epoch."""

    mode: SplitMode
    order: list[int]  # shard indices in this epoch's order
    slots: int
    natural: list[list[int]] | None  # [rank][worker] samples before evening out
    targets: list[list[int]] | None  # [rank][worker] samples after it

    def slot(self, rank: int, worker: int, world_size: int) -> int:
        # Rank r's share is the same for any number of workers: shards (or samples)
        # r, r + world_size, ... that its workers then deal out among themselves.
        return worker * world_size + rank


class ShardStream(IterableDataset[Any]):
    """Samples streamed from shard files, each seen once per epoch over all ranks and workers.

    **Split.** With at least as many shards as (rank, worker) slots, shards are dealt
    round-robin to the slots (``split_mode == "shard"``); with fewer, every slot reads
    every shard and keeps every k-th sample (``"sample"``, with a warning: it reads the
    data k times). Rank r's share does not depend on the number of workers, which must
    be the same on all ranks.

    **Even ranks.** Under DDP every rank must run the same number of steps, or the last
    all-reduce waits forever. So with ``world_size > 1`` (or ``batch_size``) the shards'
    samples are counted (once, cached in ``shard_lengths``; ``lengths=`` skips it) and
    ``uneven="drop"`` cuts every rank to the smallest share, ``"pad"`` repeats samples
    from the start of a worker's own stream up to the largest (unmarked; see
    ``padded_samples`` / ``dropped_samples``). With ``batch_size`` every worker yields
    whole batches: a DataLoader with that batch size gives all ranks equal full batches.

    **Order.** File order without a shuffle buffer. With ``shuffle_buffer > 0`` the shard
    order is shuffled per epoch (alike on all ranks) and each slot's samples pass a
    buffer seeded by ``(seed, epoch, rank, worker)``; call :meth:`set_epoch` per epoch.

    **Resume.** ``state_dict()["samples_yielded"]`` counts, per worker of this rank, the
    samples yielded this epoch; after :meth:`load_state_dict` the next pass regenerates
    the same order and skips them. The process that iterates keeps the count: exact
    with ``num_workers=0``. Workers keep their own copies, so with workers the main
    process's state records only the epoch's start (or what was loaded).

    ``len()`` (samples per rank per epoch, assuming ``num_workers``) raises TypeError
    while ``shard_lengths`` is unknown, as if ``__len__`` were not defined.
    """

    def __init__(
        self,
        shards: Sequence[str | Path] | str | Path,
        *,
        read_shard: ShardReader | None = None,
        shuffle_buffer: int = 0,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        uneven: UnevenPolicy = "drop",
        batch_size: int | None = None,
        lengths: Sequence[int] | None = None,
        num_workers: int = 0,
        bad_records: BadRecordPolicy = "error",
    ) -> None:
        """Build the stream.

        Args:
            shards: A glob pattern (``"data/train-*.jsonl"``, sorted) or a list of files.
            read_shard: Reads one shard into its samples. Without it ``.jsonl`` (one JSON
                object per line), ``.npy`` (rows, memory-mapped) and ``.pt`` (a list or
                tensor from ``torch.save``, loaded with ``weights_only=True``) are read.
                It must pickle (a module-level function) to reach worker processes.
            shuffle_buffer: Samples held in the shuffle buffer; 0 keeps the file order.
            seed: Base seed of the shard order and the buffers; the same on every rank.
            rank: This process's rank; defaults to torch.distributed's, else 0.
            world_size: Number of ranks; defaults to torch.distributed's, else 1.
            uneven: How ranks with different shares are evened out: ``drop`` or ``pad``.
            batch_size: The DataLoader's batch size; makes every worker's count a
                multiple of it.
            lengths: Samples per shard, in ``shards`` order, if known (skips counting).
            num_workers: The DataLoader's ``num_workers``, used by ``len()``,
                ``split_mode`` and the padded/dropped counts before iteration.
            bad_records: A ``.jsonl`` line that does not parse: ``error`` raises naming
                the file and line; ``skip`` yields a ``BadSample`` in its place, which the
                loader drops and logs (``data.bad_records``).

        Raises:
            DataError: No shards, a missing file, or a format without a reader.
            ConfigError: Invalid options.
        """
        self.shards = _resolve_shards(shards)
        self.read_shard = read_shard
        if read_shard is None:
            unknown = sorted({p.suffix or p.name for p in self.shards} - set(_FORMATS))
            if unknown:
                raise DataError(
                    f"no built-in reader for shard type(s) {', '.join(unknown)}; built in: "
                    f"{', '.join(_FORMATS)}.",
                    hint="pass read_shard=a function from a Path to an iterable of samples",
                )
        if bad_records not in ("error", "skip"):
            raise ConfigError(
                f"ShardStream bad_records={bad_records!r}; expected 'error' or 'skip'.",
                hint="set data.bad_records=error (stop) or skip (drop and log)",
            )
        self.bad_records: BadRecordPolicy = bad_records
        self._check_int("shuffle_buffer", shuffle_buffer, 0)
        self._check_int("num_workers", num_workers, 0)
        if batch_size is not None:
            self._check_int("batch_size", batch_size, 1)
        if uneven not in ("pad", "drop"):
            raise ConfigError(
                f"uneven={uneven!r}; expected 'drop' or 'pad'.",
                hint="uneven='drop' cuts every rank to the smallest share, 'pad' repeats "
                "samples up to the largest",
            )
        self.shuffle_buffer = shuffle_buffer
        self.seed = int(seed)
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
        self.uneven = uneven
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shard_lengths: list[int] | None = None
        if lengths is not None:
            self.shard_lengths = self._checked_lengths(lengths)
        self.epoch = 0
        self._yielded: list[int] = []  # per worker of this rank, in the iterating process
        self._resume: list[int] = []  # pending skips from load_state_dict
        self._rotation = 0  # a resumed pass's worker w reads the share of w + _rotation
        self._len_asked = False
        self.split_mode: SplitMode = self._mode(num_workers)

    @staticmethod
    def _check_int(name: str, value: Any, minimum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(
                f"ShardStream {name} must be an int >= {minimum}; got {value!r}.",
                hint=f"pass {name}= an int >= {minimum}",
            )

    def _checked_lengths(self, lengths: Sequence[int]) -> list[int]:
        values = [int(n) for n in lengths]
        if len(values) != len(self.shards) or any(n < 0 for n in values):
            raise ConfigError(
                f"lengths has {len(values)} entries (min {min(values, default=0)}); expected "
                f"one count >= 0 per shard, {len(self.shards)} in all.",
                hint="pass lengths in the order of the shards, or leave it unset to count",
            )
        return values

    def _read(self, index: int) -> Iterable[Any]:
        path = self.shards[index]
        if self.read_shard is not None:
            return self.read_shard(path)
        if path.suffix == ".jsonl":
            return _read_jsonl(path, self.bad_records)
        return _FORMATS[path.suffix][0](path)

    def count_lengths(self) -> list[int]:
        """The samples of each shard, counted once and cached in ``shard_lengths``.

        Call it before building a DataLoader with workers, so that the workers do not
        each count again.
        """
        if self.shard_lengths is None:
            read = self.read_shard
            self.shard_lengths = [
                sum(1 for _ in read(path)) if read else _FORMATS[path.suffix][1](path)
                for path in self.shards
            ]
        return self.shard_lengths

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``'s order; a different epoch starts from its beginning."""
        if int(epoch) != self.epoch:
            self._yielded, self._resume, self._rotation = [], [], 0
        self.epoch = int(epoch)

    def _mode(self, num_workers: int) -> SplitMode:
        return "shard" if len(self.shards) >= self.world_size * max(num_workers, 1) else "sample"

    def _needs_lengths(self) -> bool:
        return self.world_size > 1 or self.batch_size is not None

    def _plan(self, num_workers: int, *, count: bool = True) -> _Plan:
        workers = max(num_workers, 1)
        slots = self.world_size * workers
        order = list(range(len(self.shards)))
        if self.shuffle_buffer > 0:
            rng = random.Random(epoch_seed(self.seed, self.epoch, stream=_SHARD_ORDER_STREAM))
            rng.shuffle(order)
        mode = self._mode(num_workers)
        plan = _Plan(mode, order, slots, None, None)
        if not self._needs_lengths() and self.shard_lengths is None:
            return plan
        if self.shard_lengths is None and not count:
            return plan
        lengths = self.count_lengths()

        def share(slot: int) -> int:
            if mode == "shard":
                return sum(lengths[i] for i in order[slot::slots])
            return len(range(slot, sum(lengths), slots))

        natural = [
            [share(plan.slot(rank, worker, self.world_size)) for worker in range(workers)]
            for rank in range(self.world_size)
        ]
        targets = natural
        if self._needs_lengths():
            targets = _even_out(natural, self.uneven, self.batch_size or 1)
        return _Plan(mode, order, slots, natural, targets)

    def _excess(self) -> int | None:
        """This rank's samples per epoch after evening out minus before (None: unknown)."""
        plan = self._plan(self.num_workers, count=False)
        if plan.natural is None or plan.targets is None:
            return None if self._needs_lengths() else 0
        return sum(plan.targets[self.rank]) - sum(plan.natural[self.rank])

    @property
    def padded_samples(self) -> int | None:
        """Repeated samples this rank yields this epoch (None while lengths are unknown)."""
        excess = self._excess()
        return None if excess is None else max(excess, 0)

    @property
    def dropped_samples(self) -> int | None:
        """Samples of this rank's share left out this epoch (None while lengths are unknown)."""
        excess = self._excess()
        return None if excess is None else max(-excess, 0)

    def __len__(self) -> int:
        self._len_asked = True
        plan = self._plan(self.num_workers, count=False)
        if plan.targets is None:
            raise TypeError(
                "ShardStream has no len() until its shard lengths are known; pass lengths= "
                "or call count_lengths() first"
            )
        return sum(plan.targets[self.rank])

    def _checked(self, index: int) -> Iterator[Any]:
        """A shard's samples; when its length was planned with, a different count is an error."""
        count = 0
        for count, sample in enumerate(self._read(index), 1):  # noqa: B007
            yield sample
        expected = self.shard_lengths[index] if self.shard_lengths is not None else None
        if expected is not None and count != expected:
            raise DataError(
                f"shard {self.shards[index]} yielded {count} samples, but its length was "
                f"given (or counted) as {expected}; the ranks' shares no longer match.",
                hint="fix lengths=, or leave it unset so the stream counts the shards",
            )

    def _raw(self, plan: _Plan, slot: int, skip: int) -> Iterator[Any]:
        """The slot's samples in file order, after ``skip``; whole shards skipped unread."""
        lengths = self.shard_lengths
        if plan.mode == "shard":
            for index in plan.order[slot :: plan.slots]:
                if lengths is not None and skip >= lengths[index]:
                    skip -= lengths[index]
                    continue
                yield from itertools.islice(self._checked(index), skip, None)
                skip = 0
            return
        first = slot + skip * plan.slots  # global position of the first sample to keep
        offset = 0
        for index in plan.order:
            if lengths is not None and offset + lengths[index] <= first:
                offset += lengths[index]
                continue
            count = 0
            for count, sample in enumerate(self._checked(index), 1):
                position = offset + count - 1
                if position >= first and position % plan.slots == slot:
                    yield sample
            offset += count

    def _stream(self, plan: _Plan, slot: int, rank: int, worker: int, skip: int) -> Iterator[Any]:
        """The slot's stream for the epoch (shuffled, not yet evened out), after ``skip``."""
        if self.shuffle_buffer == 0:
            return self._raw(plan, slot, skip)
        seed = epoch_seed(epoch_seed(self.seed, self.epoch, stream=_BUFFER_STREAM), rank)
        rng = random.Random(epoch_seed(seed, worker))
        # The buffer's order depends on every sample before it: regenerate, then skip.
        return itertools.islice(
            _shuffled(self._raw(plan, slot, 0), self.shuffle_buffer, rng), skip, None
        )

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # Once: a persistent worker's copy keeps this object into the next epoch.
        worker, self._rotation = (worker + self._rotation) % workers, 0
        plan = self._plan(workers)
        self.split_mode = plan.mode
        slot = plan.slot(self.rank, worker, self.world_size)
        if self.rank == 0 and (info is None or info.id == 0):
            self._log_plan(plan, info.num_workers if info is not None else 0)
        if self._resume and len(self._resume) != workers and any(self._resume):
            raise ConfigError(
                f"ShardStream state holds positions of {len(self._resume)} worker(s), but the "
                f"DataLoader runs {workers}; a mid-epoch position needs the same num_workers.",
                hint="resume with the same loader.num_workers, or restart the epoch",
            )
        start = self._resume[worker] if worker < len(self._resume) else 0
        if start:
            self._resume[worker] = 0  # once: a second pass of the epoch starts over
        if len(self._yielded) != workers:
            self._yielded = [0] * workers
        self._yielded[worker] = start
        if plan.natural is None or plan.targets is None:
            parts: Iterable[Any] = self._stream(plan, slot, self.rank, worker, start)
        else:
            natural = plan.natural[self.rank][worker]
            target = plan.targets[self.rank][worker]
            parts = self._evened(plan, slot, worker, natural, target, start)
        for sample in parts:
            self._yielded[worker] += 1
            yield sample

    def _evened(
        self, plan: _Plan, slot: int, worker: int, natural: int, target: int, start: int
    ) -> Iterator[Any]:
        """The first ``target`` samples of the slot's stream repeated end to end, from ``start``."""
        position = start
        while position < target:
            # Padding repeats the stream from its own start: pass k begins at k * natural.
            offset = position % natural
            take = min(natural - offset, target - position)
            stream = self._stream(plan, slot, self.rank, worker, offset)
            yield from itertools.islice(stream, take)
            position += take

    def _log_plan(self, plan: _Plan, num_workers: int) -> None:
        """Says (once per epoch, from rank 0's first worker) what costs time or data."""
        if plan.mode == "sample":
            logger.warning(
                "ShardStream: %d shard(s) for %d slot(s) (ranks x workers), so every worker "
                "reads every shard and keeps every %d-th sample; give it >= %d shards",
                *(len(self.shards), plan.slots, plan.slots, plan.slots),
            )
        if self._len_asked and num_workers != self.num_workers:
            logger.warning(
                "len(ShardStream) assumed num_workers=%d, but the DataLoader runs %d; "
                "pass num_workers=%d to ShardStream",
                *(self.num_workers, num_workers, num_workers),
            )
        if plan.natural is not None and plan.targets is not None:
            natural, target = sum(map(sum, plan.natural)), sum(map(sum, plan.targets))
            if target != natural:
                logger.warning(
                    "ShardStream epoch %d: %s %d sample(s) so that each of %d rank(s) yields "
                    "%d (uneven=%r, batch_size=%s)",
                    *(self.epoch, "dropped" if target < natural else "repeated"),
                    *(abs(target - natural), self.world_size, sum(plan.targets[0])),
                    *(self.uneven, self.batch_size),
                )

    def skip_batches(
        self, batches: int, *, batch_size: int, num_workers: int, drop_last: bool = False
    ) -> None:
        """Make the next pass start after the first ``batches`` batches a DataLoader gave.

        How a loader resumes mid-epoch without reading those batches again. A DataLoader
        takes its workers' batches in turn, passing over a worker once its stream has
        ended; each worker's share is in the epoch's plan (the shards are counted once
        for it), so every worker's position follows from the count alone. Whole shards
        before a position are then skipped unread; with a shuffle buffer a slot's shards
        are read up to the position (a buffer's order depends on every sample before it),
        but nothing is decoded into batches, collated or handed on.
        """
        workers = max(num_workers, 1)
        self.count_lengths()
        plan = self._plan(num_workers)
        assert plan.targets is not None, "counted lengths give a plan with shares"
        shares = plan.targets[self.rank]
        per_worker = [n // batch_size if drop_last else math.ceil(n / batch_size) for n in shares]
        taken = [0] * workers
        left, last = int(batches), workers - 1  # `last`: the worker that gave the last batch
        while left > 0:
            active = [w for w in range(workers) if taken[w] < per_worker[w]]
            if not active:
                break
            rounds = min(left // len(active), min(per_worker[w] - taken[w] for w in active))
            for w in active:
                if rounds:
                    taken[w] += rounds
                    last = w
                elif left:  # a last, partial round: in worker order
                    taken[w] += 1
                    left -= 1
                    last = w
            left -= rounds * len(active)
        counts = [min(t * batch_size, n) for t, n in zip(taken, shares, strict=True)]
        self._resume, self._yielded = list(counts), list(counts)
        # The DataLoader starts its turns at worker 0 again, while the batch due next is
        # the following worker's: in the resumed pass, worker w reads the share of worker
        # w + rotation, and the turns then run on as they did (exhausted shares passed over).
        self._rotation = (last + 1) % workers

    def state_dict(self) -> dict[str, Any]:
        """What resumes this stream: ``{"epoch", "samples_yielded", "world_size"}``.

        ``samples_yielded`` has one count per worker of this rank (one with
        ``num_workers=0``), as seen by this process.
        """
        counts = list(self._yielded)
        return {"epoch": self.epoch, "samples_yielded": counts, "world_size": self.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next pass of that epoch skips what was yielded."""
        counts = [int(n) for n in state.get("samples_yielded", [])]
        saved_world = int(state.get("world_size", self.world_size))
        if any(counts) and saved_world != self.world_size:
            raise ConfigError(
                f"ShardStream state was saved mid-epoch with world_size={saved_world}, but "
                f"this run has world_size={self.world_size}.",
                hint="resume with the same number of processes, or set samples_yielded=[] "
                "in the state to restart the epoch",
            )
        self.epoch = int(state["epoch"])
        self._resume = counts
        self._yielded = list(counts)
        self._rotation = 0
