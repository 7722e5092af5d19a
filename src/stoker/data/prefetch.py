"""Overlapped host-to-device copies: the next batch is copied on a side CUDA stream.

While the GPU computes step *n* on the default stream, batch *n + 1* is copied from
pinned host memory on a second stream, so the copy's time disappears from the step.
Two rules keep it correct:

* **ordering** — before the training code touches a prefetched batch, the compute
  stream waits for the copy stream (``wait_stream``), so it never reads a half-copied
  tensor;
* **lifetime** — each prefetched tensor is marked as used by the compute stream
  (``record_stream``), so the caching allocator does not hand its memory to another
  tensor while kernels queued on the compute stream may still read it.

On the CPU (and MPS) there is nothing to overlap: the prefetcher passes batches
through untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from stoker.data.device import move_to_device


class DevicePrefetcher:
    """Wraps a loader so batches arrive on the device one step ahead of use."""

    def __init__(self, device: torch.device, *, enabled: bool | None = None) -> None:
        """``enabled`` None means: on for CUDA devices, off elsewhere."""
        self.device = device
        self.enabled = device.type == "cuda" if enabled is None else enabled
        if self.enabled and device.type != "cuda":
            raise ValueError(f"the side-stream prefetcher needs a CUDA device, not {device}")
        self._stream = torch.cuda.Stream(device) if self.enabled else None

    def wrap(self, batches: Iterable[Any]) -> Iterable[Any]:
        """The batches, prefetched onto the device (or unchanged when disabled)."""
        if not self.enabled:
            return batches
        return self._prefetched(iter(batches))

    def _prefetched(self, batches: Iterator[Any]) -> Iterator[Any]:
        compute = torch.cuda.current_stream(self.device)
        upcoming = self._copy_next(batches)
        while upcoming is not None:
            compute.wait_stream(self._stream)  # ordering: the copy finished first
            batch = upcoming
            _record_stream(batch, compute)  # lifetime: compute uses this memory now
            upcoming = self._copy_next(batches)  # overlaps with the step on `batch`
            yield batch

    def _copy_next(self, batches: Iterator[Any]) -> Any | None:
        try:
            host_batch = next(batches)
        except StopIteration:
            return None
        with torch.cuda.stream(self._stream):
            return move_to_device(host_batch, self.device, non_blocking=True)


def _record_stream(batch: Any, stream: torch.cuda.Stream) -> None:
    if isinstance(batch, torch.Tensor):
        if batch.is_cuda:
            batch.record_stream(stream)
    elif isinstance(batch, dict):
        for value in batch.values():
            _record_stream(value, stream)
    elif isinstance(batch, (list, tuple)):
        for value in batch:
            _record_stream(value, stream)
