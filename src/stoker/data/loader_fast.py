"""The loader's in-process fast paths: epoch indices, and in-memory arrays gathered by blocks.

For data already in memory (an :class:`~stoker.data.sources.ArrayDataset`), a batch is
one ``index_select`` per field. At that size the fixed cost of each call (dispatch,
allocation, a Python tuple, a generator step) is as large as the copy itself, so
:class:`ArrayGather` gathers many batches' rows in one call per field and hands out the
batches as row slices of that block: the same values in the same order, a fraction of
the calls. Worker processes cannot help such data, only pickle and copy what is one
gather away; :func:`serves_in_process` decides when the loader ignores them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from itertools import chain

import torch
from torch.utils.data import BatchSampler, Dataset, Sampler, SequentialSampler

from stoker.data.samplers import EpochOrderSampler, ResumableSequentialSampler, index_dtype
from stoker.data.sources import ArrayDataset

__all__ = [
    "ArrayGather",
    "epoch_batches",
    "epoch_rows",
    "in_memory_arrays",
    "in_process_note",
    "say_once",
    "serves_in_process",
]

logger = logging.getLogger("stoker")

# Rows gathered per call: a block of at most this many bytes (at least one batch). Small
# enough to stay in cache and to keep little alive behind a batch someone holds; large
# enough that a batch of 64 small rows costs a fraction of a call. Measured on the seed
# workload (64 rows x 84 bytes): 256 KiB blocks cut the loader's time per batch by ~40%.
BLOCK_BYTES = 256 * 1024
# Fewer batches than this per block: gather each batch alone. Slicing a block costs a few
# microseconds of its own, which only many batches per block repay.
MIN_BLOCK_BATCHES = 8

_said: set[str] = set()


def sampler_indices(sampler: Sampler | Iterable[int]) -> torch.Tensor:
    """One epoch of a sampler's indices as an integer tensor."""
    if isinstance(sampler, EpochOrderSampler):
        return sampler.indices()
    if isinstance(sampler, SequentialSampler):
        return torch.arange(len(sampler), dtype=index_dtype(len(sampler)))
    return torch.as_tensor(list(sampler), dtype=torch.long)


def epoch_rows(batch_sampler: BatchSampler) -> torch.Tensor:
    """The epoch's indices in batch order, without the short last batch under drop_last."""
    rows = sampler_indices(batch_sampler.sampler)
    if batch_sampler.drop_last:
        size = batch_sampler.batch_size
        rows = rows[: len(rows) // size * size]
    return rows


def epoch_batches(batch_sampler: BatchSampler, *, start: int = 0) -> Iterable[torch.Tensor]:
    """The epoch's batches of indices, as ``BatchSampler`` would cut them (never empty),
    from batch ``start`` on (a resumed pass: the ones before it are never read).

    In order, each batch is made when it is asked for: the epoch's whole index (4 bytes
    a sample, 29 MiB for the 7.6 M rows of a 2 GB file) is never held.
    """
    size = batch_sampler.batch_size
    if type(batch_sampler.sampler) in (SequentialSampler, ResumableSequentialSampler):
        total = len(batch_sampler.sampler)
        stop = total // size * size if batch_sampler.drop_last else total
        first = start * size
        return (torch.arange(at, min(at + size, stop)) for at in range(first, stop, size))
    rows = epoch_rows(batch_sampler)[start * size :]
    return [chunk for chunk in rows.split(size) if len(chunk)]


def in_memory_arrays(dataset: Dataset) -> tuple[torch.Tensor, ...] | None:
    """The fields of ``dataset`` when a batch of it is one gather per field, else None.

    That is an ArrayDataset whose ``__getitems__`` is its own: a subclass that overrides
    it (to transform, to read lazily) is read through its method, as any dataset is.
    """
    if not isinstance(dataset, ArrayDataset):
        return None
    if type(dataset).__getitems__ is not ArrayDataset.__getitems__:
        return None
    return dataset.arrays


def serves_in_process(dataset: Dataset, *, batched: bool) -> bool:
    """Whether the loader serves ``dataset`` in the training process whatever
    ``num_workers`` says: in-memory arrays fetched a batch at a time (no per-sample
    ``collate_fn``), which a worker could only pickle and copy."""
    return batched and in_memory_arrays(dataset) is not None


def _batches_per_block(arrays: tuple[torch.Tensor, ...], batch_size: int) -> int:
    row_bytes = sum(math.prod(t.shape[1:]) * t.element_size() for t in arrays)
    return max(1, BLOCK_BYTES // max(1, row_bytes * batch_size))


class ArrayGather:
    """The batches of in-memory arrays by index, planned once: by blocks, or one by one.

    Small batches are gathered a block at a time and handed out as row slices (contiguous
    views) of the block; larger ones with one gather per field each. Iteration runs in C
    (``map``, ``chain``): the only Python step per batch is the gather itself.

    Args:
        arrays: The dataset's fields (CPU or device tensors).
        batch_size: Rows per batch; the last batch holds what is left.
        pin: Pin the CPU fields for fast copies to the GPU (once per block).
    """

    def __init__(self, arrays: tuple[torch.Tensor, ...], *, batch_size: int, pin: bool) -> None:
        if any(t.device.type != "cpu" for t in arrays):
            arrays = tuple(_OnDevice(t) for t in arrays)  # type: ignore[misc]
        per_block = _batches_per_block(arrays, batch_size)
        self.arrays = arrays
        self.batch_size = batch_size
        self.pin = pin
        #: Rows per block, or 0 for one gather per batch.
        self.block_rows = per_block * batch_size if per_block >= MIN_BLOCK_BATCHES else 0
        self._gather = _gatherer(arrays, pin=pin)

    def batches(self, rows: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
        """The batches of ``rows`` (integer sample indices in batch order, on the CPU)."""
        if not len(rows):
            return iter(())
        if self.block_rows:
            return chain.from_iterable(self._blocks(rows))
        return map(self._gather, rows.split(self.batch_size))

    def _blocks(self, rows: torch.Tensor) -> Iterator[Iterator[tuple[torch.Tensor, ...]]]:
        for idx in rows.split(self.block_rows):
            fields = [t.index_select(0, idx) for t in self.arrays]
            if self.pin:
                fields = [_pinned(f) for f in fields]
            yield zip(*[f.split(self.batch_size) for f in fields], strict=True)


def _gatherer(
    arrays: tuple[torch.Tensor, ...], *, pin: bool
) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """One batch's gather; the usual one or two fields without a loop over them."""
    if pin:
        return lambda idx: tuple([_pinned(t.index_select(0, idx)) for t in arrays])
    if len(arrays) == 1:
        (first,) = arrays
        return lambda idx: (first.index_select(0, idx),)
    if len(arrays) == 2:
        first, second = arrays
        return lambda idx: (first.index_select(0, idx), second.index_select(0, idx))
    return lambda idx: tuple([t.index_select(0, idx) for t in arrays])


def _pinned(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.pin_memory() if tensor.device.type == "cpu" else tensor


class _OnDevice:
    """A field on another device than the indices: ``index_select`` moves them first."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.device = tensor.device

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def element_size(self) -> int:
        return self.tensor.element_size()

    def index_select(self, dim: int, idx: torch.Tensor) -> torch.Tensor:
        return self.tensor.index_select(dim, idx.to(self.tensor.device))


def in_process_note(num_workers: int) -> str:
    """What the loader says when it serves in-memory data without its workers."""
    return (
        f"loader: in-memory data, serving batches in-process; num_workers={num_workers} "
        "ignored (a batch is one gather away: workers would only pickle and copy it)"
    )


def say_once(line: str, *, key: str | None = None) -> None:
    """Log ``line`` at INFO the first time this process meets its ``key`` (default: itself).

    The doctor and the tuner rebuild loaders at many worker counts; one line is enough.
    """
    key = line if key is None else key
    if key not in _said:
        _said.add(key)
        logger.info(line)
