"""Rank-aware views of data that the samplers do not split: the validation set."""

from __future__ import annotations

from torch.utils.data import Dataset, IterableDataset, Subset

from stoker.data.samplers import rank_and_world_size


def rank_share(dataset: Dataset) -> Dataset:
    """This rank's samples ``rank, rank + world, ...`` of a map-style dataset.

    No padding and no repeats: every sample is evaluated exactly once over the ranks,
    so metric sums reduced across ranks equal one process's. With one process, or for
    a stream (which splits itself), the dataset is returned as is.
    """
    rank, world_size = rank_and_world_size()
    if world_size == 1 or isinstance(dataset, IterableDataset):
        return dataset
    return Subset(dataset, range(rank, len(dataset), world_size))  # type: ignore[arg-type]
