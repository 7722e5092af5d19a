"""The loader's collate wrappers: bad samples taken out before collating, and a per-sample view."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from stoker.data.collate import default_collate
from stoker.data.records import BadSample, FilteredBatch

__all__ = ["OrderedBatch", "PerSampleView", "collated_size", "skip_bad_collate"]


class PerSampleView(Dataset):
    """A dataset seen one sample at a time (no ``__getitems__``): for a user collate_fn,
    and for the doctor and tuner, which measure per-sample fetch against batched."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]


@dataclass(frozen=True)
class OrderedBatch(FilteredBatch):
    """A FilteredBatch that keeps the order of its records, so runs of bad ones count exactly.

    ``runs`` holds ``(bad, good)`` counts in batch order: ``((2, 5), (1, 0))`` is two bad
    records, five good ones, then one bad one.
    """

    runs: tuple[tuple[int, int], ...] = ()


class _SkipBadCollate:
    """Collate only the good samples; report the bad ones (see :func:`skip_bad_collate`)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        # One type check per sample; this path already does Python work per sample.
        if not any(isinstance(sample, BadSample) for sample in samples):
            return self.collate_fn(samples)
        good: list[Any] = []
        bad: list[BadSample] = []
        runs: list[tuple[int, int]] = []
        bad_run = good_run = 0
        for sample in samples:
            if isinstance(sample, BadSample):
                if good_run:
                    runs.append((bad_run, good_run))
                    bad_run = good_run = 0
                bad.append(sample)
                bad_run += 1
            else:
                good.append(sample)
                good_run += 1
        runs.append((bad_run, good_run))
        return OrderedBatch(self.collate_fn(good) if good else None, bad, runs=tuple(runs))

    def __repr__(self) -> str:
        return f"skip_bad_collate({self.collate_fn!r})"


def skip_bad_collate(
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Callable[[list[Any]], Any]:
    """Wrap a collate function so samples that are :class:`BadSample` never reach it.

    Sources under ``bad_records="skip"`` return a ``BadSample`` in place of a record they
    cannot read. The wrapped function collates the other samples with ``collate_fn`` and,
    when any were bad, returns ``FilteredBatch(batch, bad)`` (``batch`` is None when every
    sample was bad); :class:`EpochLoader` unwraps it. ``build_loader`` applies it to every
    per-sample collate function, yours included.

    Args:
        collate_fn: The collate function for the good samples (default: ``default_collate``).

    Returns:
        A picklable collate function, as cheap as ``collate_fn`` when nothing is bad.
    """
    if isinstance(collate_fn, _SkipBadCollate):
        return collate_fn
    return _SkipBadCollate(collate_fn if collate_fn is not None else default_collate)


def collated_size(batch: Any) -> int:
    """Samples in a collated batch, as far as its first field tells (at least 1)."""
    size = 1
    while isinstance(batch, tuple | list | dict) and batch:
        # A list of strings is itself a batch of texts; a list of tensors is a batch's fields.
        size = len(batch)
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    if isinstance(batch, torch.Tensor) and batch.dim() > 0:
        return int(batch.shape[0])
    return size
