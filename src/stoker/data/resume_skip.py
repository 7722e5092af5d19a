"""Mid-epoch resume by position: the loader starts past what was trained on, reading none of it.

Every order a loader follows is a function of ``(seed, epoch)``: a sampler's permutation,
a bucketing's batches, a shard stream's plan. So a resume at batch ``k`` need not fetch
``k`` batches to throw them away (what a DataLoader's own replay costs: most of an
epoch's I/O for a resume late in it); the index source is told to start after them.

One thing the replay gave for free has to be made explicit: a worker process draws its
random numbers (a user's ``torch.rand`` augmentation) from a stream seeded once per
worker, so what it draws for a batch depends on the batches it read before, and after a
skip the workers deal out the batches differently. :class:`SeededFetch` seeds the
worker's global RNGs before each batch from ``(seed, epoch, the batch's indices)``, so a
batch is the same whichever worker reads it, after whatever it read before.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

from stoker.data.bucketing import LengthBucketBatchSampler
from stoker.data.samplers import EpochOrderSampler, ResumableSequentialSampler, epoch_seed
from stoker.data.streaming import ShardStream
from stoker.data.transforms import SharedEpoch
from stoker.data.worker_faults import NamedFetch

__all__ = ["SeededFetch", "batch_seed", "start_past"]

# An epoch_seed stream of its own (see transforms._AUGMENT_STREAM for the ones taken).
_FETCH_STREAM = (1 << 33) + 1
_MASK64 = (1 << 64) - 1


def start_past(dataloader: DataLoader, batches: int) -> bool:
    """Make ``dataloader``'s next pass start after its first ``batches`` batches, unread.

    Returns:
        True when the index source was positioned; False when it cannot be (a sampler or
        stream of the user's own), and the caller must replay the pass instead.
    """
    dataset = dataloader.dataset
    if isinstance(dataset, ShardStream):
        if dataloader.batch_size is None:
            return False
        dataset.skip_batches(
            batches,
            batch_size=dataloader.batch_size,
            num_workers=dataloader.num_workers,
            drop_last=dataloader.drop_last,
        )
        return True
    if dataloader.num_workers > 0 and not isinstance(dataset, SeededFetch):
        # Workers that draw from their own per-worker streams (a DataLoader built by
        # hand) give a batch other numbers when the batches are dealt out differently.
        return False
    batch_sampler = dataloader.batch_sampler
    if isinstance(batch_sampler, LengthBucketBatchSampler):
        batch_sampler.skip(batches)
        return True
    if type(batch_sampler) is BatchSampler:
        sampler = batch_sampler.sampler
        if isinstance(sampler, EpochOrderSampler | ResumableSequentialSampler):
            sampler.skip(batches * batch_sampler.batch_size)
            return True
    return False


def batch_seed(seed: int, epoch: int, indices: Any) -> int:
    """The seed of one batch's fetch: ``(seed, epoch)`` mixed with the batch's indices."""
    if isinstance(indices, torch.Tensor):
        indices = indices.tolist()
    # A tuple of ints hashes the same in every process (only str/bytes hashes are salted).
    return epoch_seed(epoch_seed(seed, epoch, stream=_FETCH_STREAM), hash(tuple(indices)) & _MASK64)


class SeededFetch(NamedFetch):
    """:class:`NamedFetch` for worker processes: each batch read under seeds of its own.

    Before each batch, torch's CPU generator, ``random`` and numpy's global generator are
    seeded from :func:`batch_seed`, which is what PyTorch seeds once per worker. A worker
    is a process of its own, so nothing else draws from them there. The epoch lives in
    shared memory (:class:`SharedEpoch`) to reach persistent workers.
    """

    def __init__(self, dataset: Dataset, *, batched: bool, seed: int) -> None:
        super().__init__(dataset, batched=batched)
        self._fetch_seed = int(seed)
        self._fetch_epoch = SharedEpoch(0)

    def set_fetch_epoch(self, epoch: int) -> None:
        """Select the epoch the next batches are seeded for."""
        self._fetch_epoch.value = epoch

    def __getitems__(self, indices: list[int]) -> Any:
        seed = batch_seed(self._fetch_seed, self._fetch_epoch.value, indices)
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)  # the global generator: what a user's dataset draws from
        return super().__getitems__(indices)
