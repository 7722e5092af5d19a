"""build_loader(): a DataLoader with batched fetch, per-epoch seeding and checked options."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    Subset,
    TensorDataset,
)
from torch.utils.data._utils.pin_memory import pin_memory

from stoker.data.bucketing import LengthBucketBatchSampler, bucket_lengths
from stoker.data.collate import passthrough
from stoker.data.loader_checks import (
    SamplerName,
    option_problems,
    raise_all,
    resolve_pin_memory,
    resolve_sampler,
)
from stoker.data.loader_collate import (
    OrderedBatch,
    PerSampleView,
    collated_size,
    skip_bad_collate,
)
from stoker.data.loader_fast import (
    ArrayGather,
    epoch_batches,
    epoch_rows,
    in_memory_arrays,
    in_process_note,
    say_once,
    serves_in_process,
)
from stoker.data.records import BadRecordLog, FilteredBatch
from stoker.data.resume_skip import SeededFetch, start_past
from stoker.data.samplers import (
    BlockShuffleSampler,
    EpochRandomSampler,
    ResumableSequentialSampler,
    epoch_seed,
    rank_and_world_size,
)
from stoker.data.sources import ArrayDataset
from stoker.data.weighted import weighted_sampler_for
from stoker.data.worker_faults import NamedFetch, sample_error
from stoker.data.worker_watch import DEFAULT_TIMEOUT_S, WorkerInit, WorkerWatch, poll_interval
from stoker.errors import DataError, StokerError

__all__ = ["EpochLoader", "PerSampleView", "SamplerName", "build_loader", "skip_bad_collate"]

# Separates the worker-seed stream from the sampler's permutation stream of one epoch.
_WORKER_STREAM = 1


def _returns_batches(dataset: Dataset[Any]) -> bool:
    """Whether ``dataset.__getitems__`` yields one collated batch (also through a Subset)."""
    if isinstance(dataset, Subset):
        return _returns_batches(dataset.dataset)
    return bool(getattr(dataset, "returns_batches", False)) and hasattr(dataset, "__getitems__")


class EpochLoader:
    """A DataLoader whose shuffling and worker seeds are fixed by ``(seed, epoch)``.

    Iterate it like the DataLoader it wraps. Before each pass it re-seeds the
    DataLoader's generator for the current epoch, so worker seeds (and the
    augmentation drawn from them) repeat exactly on resume. A pass that runs to the
    end advances ``epoch`` by one; :meth:`set_epoch` sets it explicitly.

    With ``persistent_workers`` the workers are seeded once, on the first pass, and
    keep their RNG state across epochs (PyTorch's behaviour).

    Records a source skipped (``bad_records="skip"``) arrive as a ``FilteredBatch``; the
    loader hands them to :attr:`bad_records`, drops batches with no good record left and
    yields plain batches only, so the training loop never sees either type.

    With worker processes, a worker that dies, hangs past ``timeout_s`` or fails is
    reported as a DataError naming it, and the workers are shut down first (see
    :mod:`stoker.data.worker_watch`).

    Attributes:
        bad_records: Counts, writes and limits skipped records; count-only by default.
            Set it to ``BadRecordLog(run_dir / "bad_records.jsonl", ...)`` to keep them.
        note: A line for people about how batches are served, e.g. that in-memory data
            is served in-process and ``num_workers`` ignored; None when nothing to say.
    """

    def __init__(
        self,
        dataloader: DataLoader[Any],
        *,
        seed: int = 0,
        epoch: int = 0,
        dataset: Dataset[Any] | None = None,
        returns_batches: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Wrap ``dataloader``.

        Args:
            dataloader: The DataLoader; its ``generator`` (if any) is re-seeded per epoch.
            seed: Base seed, mixed with the epoch.
            epoch: The epoch of the first pass.
            dataset: The dataset as the user sees it; defaults to ``dataloader.dataset``.
            returns_batches: Whether the dataset fetches whole batches (reported only).
            timeout_s: With workers: a worker that delivers no batch for this long is an
                error (0: wait forever); defaults to the DataLoader's ``timeout``.
        """
        self.dataloader = dataloader
        fetched = dataloader.dataset
        # What the DataLoader reads, without the wrapper that names failing samples.
        self._fetched = fetched.dataset if isinstance(fetched, NamedFetch) else fetched
        self.dataset = dataset if dataset is not None else self._fetched
        self.timeout_s = float(dataloader.timeout if timeout_s is None else timeout_s)
        self._watch = (
            WorkerWatch(dataloader, timeout_s=self.timeout_s, dataset=self.dataset)
            if dataloader.num_workers > 0
            else None
        )
        self.batch_size = dataloader.batch_size
        self.seed = int(seed)
        self.returns_batches = returns_batches
        # In the main process the DataLoader iterator only adds per-batch overhead
        # (profiler ranges, list-of-int indices); fetch the same batches directly.
        self._direct = (
            returns_batches
            and dataloader.num_workers == 0
            and dataloader.collate_fn is passthrough
            and type(dataloader.batch_sampler) is BatchSampler
        )
        # Plain in-memory arrays: batches gathered by blocks (see loader_fast).
        arrays = in_memory_arrays(self._fetched) if self._direct else None
        self._gather = (
            ArrayGather(arrays, batch_size=self.batch_size, pin=dataloader.pin_memory)
            if arrays is not None and self.batch_size is not None
            else None
        )
        self.note: str | None = None
        self.bad_records = BadRecordLog(None)
        self.epoch = 0
        #: Batches handed out in the current epoch (0 before its pass starts), those
        #: before a resumed position included.
        self.batches_delivered = 0
        self._skip = 0
        # Batches of the index source read (delivered, and all-bad ones dropped) at the
        # position resumed from, and the delivered count at each drop since (see
        # batches_read); they map a delivered count to where the source must restart.
        self._resumed_read = 0
        self._resumed_delivered = 0
        self._drops: list[int] = []
        self.set_epoch(epoch)

    @property
    def sampler(self) -> Sampler[Any] | None:
        """The sampler of a map-style dataset (the batch sampler when bucketing), or None."""
        if isinstance(self.dataloader.dataset, IterableDataset):
            return None
        if isinstance(self.dataloader.batch_sampler, LengthBucketBatchSampler):
            return self.dataloader.batch_sampler
        return self.dataloader.sampler  # type: ignore[return-value]

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``; forwarded to the sampler and dataset when they take it.

        Selecting another epoch than the current one drops a resumed position.
        """
        if int(epoch) != self.epoch:
            self._skip = self._resumed_read = 0
        self.batches_delivered = 0
        self.epoch = int(epoch)
        if isinstance(self.dataloader.dataset, SeededFetch):
            self.dataloader.dataset.set_fetch_epoch(self.epoch)
        for part in (self.sampler, self.dataset):
            set_part_epoch = getattr(part, "set_epoch", None)
            if callable(set_part_epoch):
                set_part_epoch(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        """One pass over the data (resumed after the delivered batches, after a resume)."""
        return self._gathered_pass() if self._gather is not None else self._pass()

    def _begin_pass(self) -> int:
        """Seed this pass's workers; returns the batches a resume skips (taken once)."""
        generator = self.dataloader.generator
        if generator is not None:
            # Worker base seeds are drawn from this generator when the iterator is built.
            generator.manual_seed(epoch_seed(self.seed, self.epoch, stream=_WORKER_STREAM))
        skip, self._skip = self._skip, 0
        self._resumed_delivered = self.batches_delivered = skip
        if not skip:
            self._resumed_read = 0
        self._drops = []
        return skip

    def batches_read(self, delivered: int) -> int:
        """Batches of the index source read by the time ``delivered`` batches were handed out.

        More than ``delivered`` when batches whose every record was bad were dropped.
        """
        if delivered < self._resumed_delivered:
            return delivered
        dropped = sum(1 for at in self._drops if at < delivered)
        return self._resumed_read + delivered - self._resumed_delivered + dropped

    def _gathered_pass(self) -> Iterator[Any]:
        """In-memory arrays: the batches of the in-process DataLoader, gathered by blocks.

        Gathering is pure (no state, no randomness, no bad records), so a resumed pass
        starts at its first undelivered batch without reading the ones before it.
        """
        skip = self._begin_pass()  # no workers to seed
        rows = epoch_rows(self.dataloader.batch_sampler)  # type: ignore[arg-type]
        if skip:
            rows = rows[skip * self._gather.batch_size :]  # type: ignore[union-attr]
        for batch in self._gather.batches(rows):  # type: ignore[union-attr]
            self.batches_delivered += 1
            yield batch
        self.set_epoch(self.epoch + 1)

    def _pass(self) -> Iterator[Any]:
        skip = self._begin_pass()
        read = self._resumed_read if skip else 0
        batches: Iterable[Any]
        # Resuming mid-epoch: the index source starts past the batches already trained
        # on, none of them read again (see resume_skip).
        if self._direct:
            batches, skip = self._direct_batches(read), 0
        else:
            if skip and start_past(self.dataloader, read):
                skip = 0
            batches = self._watch.batches() if self._watch is not None else self.dataloader
        # A sampler or stream of one's own cannot be positioned: replay the pass and drop
        # the batches already trained on. Every order and seed here is a function of
        # (seed, epoch), so the replay is exact; it costs reading those batches.
        replayed = 0
        log = self.bad_records
        # Skipped records of replayed batches were logged before the restart.
        unlogged = BadRecordLog(None, max_total=2**62, max_consecutive=2**62)
        for batch in batches:
            replaying = replayed < skip
            if isinstance(batch, FilteredBatch):
                batch = self._unwrap(batch, log=unlogged if replaying else log)
                if batch is None:
                    if not replaying:
                        self._drops.append(self.batches_delivered)
                    continue
            elif log.consecutive and not replaying:
                log.record_good(collated_size(batch))
            if replaying:
                replayed += 1
                continue
            self.batches_delivered += 1
            yield batch
        self.set_epoch(self.epoch + 1)

    def _unwrap(self, filtered: FilteredBatch, *, log: BadRecordLog) -> Any:
        """Log the skipped records of ``filtered``; its good part (None when none is left)."""
        batch = filtered.batch
        if isinstance(filtered, OrderedBatch):
            start = 0
            for bad, good in filtered.runs:
                log.record_bad(filtered.bad[start : start + bad])
                log.record_good(good)
                start += bad
        else:
            # A batched source keeps no order: count its bad records before its good ones.
            log.record_bad(filtered.bad)
            if batch is not None:
                log.record_good(collated_size(batch))
        # PyTorch's pinning passes a FilteredBatch through untouched; pin what is left.
        if batch is not None and self.dataloader.pin_memory:
            batch = pin_memory(batch)  # type: ignore[no-untyped-call]  # torch: unannotated
        return batch

    def _direct_batches(self, start: int = 0) -> Iterator[Any]:
        """The batches the single-process DataLoader would yield, from batch ``start`` on,
        fetched with less overhead."""
        batch_sampler = self.dataloader.batch_sampler
        assert isinstance(batch_sampler, BatchSampler)
        chunks = epoch_batches(batch_sampler, start=start)
        dataset = self._fetched
        fetch = dataset.__getitems__  # type: ignore[attr-defined]
        # ArrayDataset takes index tensors; other datasets get the list[int] PyTorch passes.
        as_list = not isinstance(dataset, ArrayDataset)
        pin = self.dataloader.pin_memory
        for idx in chunks:
            try:
                batch = fetch(idx.tolist() if as_list else idx)
            except StokerError:
                raise
            except Exception as error:
                raise sample_error(error, dataset, idx, batched=True) from error
            yield pin_memory(batch) if pin else batch  # type: ignore[no-untyped-call]  # (same)

    def close(self) -> None:
        """Stops the current pass's workers now; a later pass starts fresh ones.

        Persistent workers otherwise outlive the run that used them: the loader sits in
        reference cycles (the loop, callbacks), so they stay until a garbage collection,
        each holding a copy of the dataset (five were seen alive across a tuner's runs).
        """
        if self._watch is not None:
            self._watch.release()

    def __len__(self) -> int:
        try:
            return len(self.dataloader)
        except TypeError as error:
            raise TypeError(
                f"this loader streams a {type(self.dataloader.dataset).__name__} "
                "(an IterableDataset) without __len__, so its number of batches is unknown; "
                "define __len__ on the dataset, or iterate without calling len()"
            ) from error

    def state_dict(self, *, batches_consumed: int | None = None) -> dict[str, int]:
        """What resumes this loader: ``{"epoch"}``, and mid-epoch ``batches_delivered``.

        Args:
            batches_consumed: Batches the training loop has finished with, when it differs
                from the batches handed out (a prefetcher holds one ahead).
        """
        done = self.batches_delivered if batches_consumed is None else batches_consumed
        if not done:
            return {"epoch": self.epoch}
        state = {"epoch": self.epoch, "batches_delivered": done}
        read = self.batches_read(done)
        return state | {"batches_read": read} if read != done else state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`: the next pass starts after the delivered batches.

        ``batches_read`` (present when batches of bad records only were dropped) is where
        the index source restarts; ``batches_delivered`` what the loop counts.
        """
        self.set_epoch(int(state["epoch"]))
        self._skip = int(state.get("batches_delivered", 0))
        self._resumed_read = int(state.get("batches_read", self._skip))

    def __repr__(self) -> str:
        return (
            f"EpochLoader(dataset={type(self.dataset).__name__}, batch_size={self.batch_size}, "
            f"epoch={self.epoch}, returns_batches={self.returns_batches})"
        )


def _dataset_length(dataset: Dataset[Any]) -> int:
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError as error:
        raise DataError(
            f"{type(dataset).__name__} is a map-style Dataset without __len__; "
            "the loader needs the number of samples to index it.",
            hint="define __len__ on the dataset, or make it an IterableDataset",
        ) from error
    if length == 0:
        raise DataError(
            f"{type(dataset).__name__} has 0 samples; expected at least one.",
            hint="check the data path and any filtering that produced the dataset",
        )
    return length


def build_loader(
    dataset: Dataset[Any],
    *,
    batch_size: int = 64,
    shuffle: bool = False,
    drop_last: bool = False,
    sampler: SamplerName = "auto",
    weights: torch.Tensor | np.ndarray | Sequence[float] | Literal["balanced"] | None = None,
    num_samples: int | None = None,
    num_workers: int = 0,
    pin_memory: bool | Literal["auto"] = "auto",
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
    bucket_size_multiplier: int = 50,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    split_across_ranks: bool = True,
) -> EpochLoader:
    """Build a DataLoader with stoker's fast paths, wrapped in an :class:`EpochLoader`.

    Datasets that fetch whole batches (``ArrayDataset``; a ``TensorDataset`` is
    converted to one without copying) get a pass-through collate, so each batch is one
    gather per field. Any other map-style or iterable dataset is used as is.

    Args:
        dataset: A map-style ``Dataset`` or an ``IterableDataset``.
        batch_size: Samples per batch.
        shuffle: Shuffle each epoch (picks the ``random`` sampler under ``auto``).
        drop_last: Drop the last, smaller batch.
        sampler: ``auto`` (``weighted`` if weights are given, else ``random`` if shuffle,
            else ``sequential``), ``sequential``, ``random``, ``weighted``, or ``bucket``
            (batches of similar length, from the dataset's ``lengths()``, to pad less).
        weights: Per-sample weights for the weighted sampler, or ``"balanced"`` to
            weight each sample by ``1 / count(its class)``.
        num_samples: Draws per epoch for the weighted sampler (default: dataset length).
        num_workers: Worker processes; 0 loads in the main process. Ignored for an
            ``ArrayDataset`` (in memory, no collate_fn of yours): its batches are served
            in-process, faster than any worker could, and ``loader.note`` says so.
        pin_memory: Pin batches for faster copies to the GPU; ``auto`` pins when CUDA is
            available and ``device`` (if given) is a CUDA device.
        persistent_workers: Keep workers alive between epochs (needs ``num_workers > 0``).
        prefetch_factor: Batches each worker loads ahead (needs ``num_workers > 0``).
        collate_fn: Your collate function; it receives a list of samples, with any
            ``BadSample`` (``bad_records="skip"``) already taken out.
        seed: Base seed of shuffling, weighted draws and worker seeds.
        device: The training device, used to decide ``pin_memory="auto"``.
        bucket_size_multiplier: With ``bucket``: a bucket holds this many batches.
        timeout_s: With workers: a worker that delivers no batch for this long is an
            error that shows its stack; 0 waits forever.
        split_across_ranks: Under torch.distributed, give each rank its share (also
            without shuffling). False for data already cut per rank (validation).

    Returns:
        The loader.

    Raises:
        ConfigError: Invalid or conflicting options, all listed, each by its ``loader.*`` key.
        DataError: An empty dataset, a map-style dataset without ``__len__``, or
            ``weights="balanced"`` for a dataset whose labels are unknown. While
            iterating: a failing sample (:class:`~stoker.data.worker_faults.SampleError`,
            naming its index), or a dead, hung or failing worker, named.
    """
    problems = option_problems(
        batch_size=batch_size,
        num_workers=num_workers,
        num_samples=num_samples,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
        pin_memory=pin_memory,
        sampler=sampler,
        timeout_s=timeout_s,
    )
    resolved = resolve_sampler(
        sampler,
        shuffle=shuffle,
        weights=weights,
        num_samples=num_samples,
        dataset=dataset,
        problems=problems,
    )
    raise_all(problems)

    streaming = isinstance(dataset, IterableDataset)
    if isinstance(dataset, TensorDataset):
        dataset = ArrayDataset.from_tensor_dataset(dataset)
    length = 0 if streaming else _dataset_length(dataset)

    batched = not streaming and _returns_batches(dataset)
    if batched and collate_fn is None:
        collate_fn = passthrough
    else:
        # A user collate_fn expects a list of samples, as PyTorch gives it.
        batched = False
        # Samples may be BadSample stand-ins (bad_records="skip"); never collate those.
        collate_fn = skip_bad_collate(collate_fn)
    note = None
    if num_workers > 0 and serves_in_process(dataset, batched=batched):
        # A batch of in-memory arrays is one gather away: workers would only pickle and
        # copy it between processes (measured 50-300x slower than gathering in-process).
        note = in_process_note(num_workers)
        say_once(note, key="in-process")
        num_workers = 0
    # Read through a wrapper, so that an exception names the sample (and worker); in
    # workers each batch under seeds of its own, so a resume may skip batches exactly.
    fetched: Dataset[Any] = dataset
    if not streaming:
        fetched = (
            SeededFetch(dataset, batched=batched, seed=seed)
            if num_workers > 0
            else NamedFetch(dataset, batched=batched)
        )

    index_sampler: Sampler[Any] | None = None
    if resolved == "random" and callable(getattr(dataset, "row_group_offsets", None)):
        # Read by row groups (Parquet): shuffle blocks, then within a few at a time.
        index_sampler = BlockShuffleSampler(dataset.row_group_offsets(), seed=seed)  # type: ignore[attr-defined]
    elif resolved == "random":
        index_sampler = EpochRandomSampler(length, seed=seed)
    elif resolved == "weighted":
        index_sampler = weighted_sampler_for(dataset, weights, num_samples=num_samples, seed=seed)
    elif not streaming and split_across_ranks and rank_and_world_size()[1] > 1:
        # In order, but split across the ranks (else every rank would read everything).
        index_sampler = EpochRandomSampler(length, seed=seed, shuffle=False)
    elif not streaming:
        index_sampler = ResumableSequentialSampler(fetched)

    worker_options: dict[str, Any] = {}
    if num_workers > 0:
        worker_options["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            worker_options["prefetch_factor"] = prefetch_factor
        # Short: the EpochLoader's watch polls, checks workers and enforces timeout_s.
        worker_options["timeout"] = poll_interval(timeout_s)
        worker_options["worker_init_fn"] = WorkerInit()

    if resolved == "bucket":
        batching: dict[str, Any] = {
            "batch_sampler": LengthBucketBatchSampler(
                bucket_lengths(dataset),
                batch_size=batch_size,
                bucket_size_multiplier=bucket_size_multiplier,
                shuffle=shuffle,
                drop_last=drop_last,
                seed=seed,
            )
        }
    else:
        batching = {"batch_size": batch_size, "sampler": index_sampler, "drop_last": drop_last}
    dataloader = DataLoader(
        fetched,
        shuffle=False,
        **batching,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=resolve_pin_memory(pin_memory, device),
        # Re-seeded by EpochLoader before every pass; never the global RNG.
        generator=torch.Generator(),
        **worker_options,
    )
    loader = EpochLoader(
        dataloader, seed=seed, dataset=dataset, returns_batches=batched, timeout_s=timeout_s
    )
    loader.note = note
    return loader
