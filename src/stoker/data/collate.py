"""Collate functions: pure functions from what a dataset returns to one batch."""

from __future__ import annotations

from typing import TypeVar

from torch.utils.data import default_collate

__all__ = ["default_collate", "passthrough"]

T = TypeVar("T")


def passthrough(batch: T) -> T:
    """Return ``batch`` unchanged.

    The collate function for datasets whose ``__getitems__`` already returns a
    collated batch (``returns_batches = True``), so no per-sample work is done.
    """
    return batch
