"""``data.cache: memory`` for a user's per-sample Dataset: read it once into arrays, then
serve whole batches.

A Dataset that returns one sample per ``__getitem__`` costs a Python call, a few small
tensors and a collate step per sample, every epoch; for a small model that is most of
the step. When every sample is the same every time it is read (no random
augmentation), the dataset can be read once into one array per field and served as an
:class:`~stoker.data.sources.ArrayDataset`, whose batches are one gather per field.
The batches hold what the default collate function would have made of the samples
(the same values and dtypes), so nothing else in the run changes.

:func:`materialize` checks that the dataset is deterministic before it trusts it: it
reads the first and last samples twice (and, for a dataset with ``set_epoch``, in
another epoch too) and gives up, returning None, when they differ; the caller then
falls back to the per-sample cache, which keeps the first epoch's samples.
"""

from __future__ import annotations

import logging
import numbers
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stoker.data.sources import ArrayDataset

__all__ = ["materialize"]

logger = logging.getLogger("stoker")


def materialize(dataset: Dataset) -> ArrayDataset | None:
    """``dataset`` read once into an ArrayDataset, or None when it cannot be.

    None when a sample is not a tensor, a numpy array, a number, or a tuple or list of
    those with one shape per field, or when reading a sample twice gives two results.
    """
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if length == 0 or not _deterministic(dataset, length):
        return None
    first = _fields(dataset[0])
    if first is None:
        return None
    arrays = [torch.empty((length, *value.shape), dtype=value.dtype) for value in first]
    for index in range(length):
        fields = first if index == 0 else _fields(dataset[index])
        if fields is None or len(fields) != len(arrays):
            return None
        for array, value in zip(arrays, fields, strict=True):
            if value.shape != array.shape[1:] or value.dtype != array.dtype:
                return None  # a field of another shape: only a per-sample collate fits
            array[index] = value
    logger.info(
        "data.cache=memory: read %d samples of %s once into arrays (%s)",
        length,
        type(dataset).__name__,
        ", ".join(f"{tuple(a.shape)} {str(a.dtype).removeprefix('torch.')}" for a in arrays),
    )
    return ArrayDataset(*arrays)


def _fields(sample: Any) -> list[torch.Tensor] | None:
    """A sample's fields as tensors, typed as ``default_collate`` types them."""
    values = list(sample) if isinstance(sample, tuple | list) else [sample]
    fields = []
    for value in values:
        field = _as_tensor(value)
        if field is None:
            return None
        fields.append(field)
    if not isinstance(sample, tuple | list):
        return None if len(fields) != 1 else fields
    return fields


def _as_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return torch.from_numpy(value)
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return torch.as_tensor(value)
    # Python numbers: default_collate makes int64 of ints, float64 of floats.
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, numbers.Integral):
        return torch.tensor(int(value), dtype=torch.long)
    if isinstance(value, numbers.Real):
        return torch.tensor(float(value), dtype=torch.float64)
    return None


def _deterministic(dataset: Any, length: int) -> bool:
    """Whether the first and last samples read the same twice, and in another epoch."""
    probes = sorted({0, length - 1})
    seen = [_fields(dataset[i]) for i in probes]
    again = [_fields(dataset[i]) for i in probes]
    set_epoch = getattr(dataset, "set_epoch", None)
    if callable(set_epoch):
        before = getattr(dataset, "epoch", 0)
        set_epoch(before + 1)
        try:
            again += [_fields(dataset[i]) for i in probes]
        finally:
            set_epoch(before)
        seen = seen * 2
    return all(
        a is not None
        and b is not None
        and len(a) == len(b)
        and all(
            x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
            for x, y in zip(a, b, strict=True)
        )
        for a, b in zip(seen, again, strict=True)
    )
