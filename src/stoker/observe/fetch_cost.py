"""What one sample costs to fetch: ``dataset[i]`` alone, its CPU share, collate, and a
batched ``__getitems__``."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Subset, default_collate

__all__ = ["FetchFigures", "measure_fetch", "supports_batched_fetch"]


def supports_batched_fetch(dataset: Dataset) -> bool:
    """Whether the dataset itself defines ``__getitems__`` (a Subset only forwards it)."""
    if isinstance(dataset, Subset):
        return supports_batched_fetch(dataset.dataset)
    return hasattr(type(dataset), "__getitems__")


def _run_queue_wait_s() -> float:
    """Seconds this thread has spent runnable but waiting for a core (Linux), else 0.

    The second field of ``/proc/thread-self/schedstat`` (nanoseconds); where the file
    is missing (other systems, kernels without scheduler statistics) the CPU share is
    CPU time over wall time, as before.
    """
    try:
        with open("/proc/thread-self/schedstat", "rb") as file:
            return int(file.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass(frozen=True)
class FetchFigures:
    """What one sample costs to fetch, alone (``dataset[i]``) and in a batch.

    ``cpu_share`` is the process CPU time over the wall time of ``dataset[i]`` less the
    time the thread waited for a core: near 1 when fetching computes (decode, augment),
    near 0 when it waits (disk, network, sleep), however busy the machine is.
    """

    per_sample_s: float
    cpu_share: float
    collate_per_sample_s: float | None
    batched_per_sample_s: float | None
    supports_batched: bool
    #: ``dataset[i]`` over consecutive indices, as a cache's fill reads them, per sample
    #: (a mean: a source that decodes blocks, Parquet row groups, serves the neighbours
    #: from the block it decoded; random reads paid 1.2 ms a sample, the fill 0.1 ms).
    fill_per_sample_s: float | None = None


# --- (e) per-sample fetch cost ---------------------------------------------------------


def measure_fetch(
    dataset: Dataset,
    *,
    batch_size: int,
    collate_fn: Callable[[list[Any]], Any] | None,
    seconds: float,
    seed: int = 0,
) -> FetchFigures | None:
    """Median time of ``dataset[i]``, of collating a batch, and of a batched fetch.

    Returns None for a stream (an IterableDataset has no ``dataset[i]``).
    """
    if isinstance(dataset, IterableDataset):
        return None
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return None
    if length == 0:
        return None
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randint(length, (max(batch_size, 1),), generator=generator).tolist()
    budget = seconds / 3
    dataset[indices[0]]  # warm-up: lazy opens, caches
    per_sample: list[float] = []
    samples = []
    started, cpu_started = time.perf_counter(), time.process_time()
    queued_started = _run_queue_wait_s()
    for i in (indices * 64)[:4096]:
        t0 = time.perf_counter()
        sample = dataset[i]
        per_sample.append(time.perf_counter() - t0)
        if len(samples) < batch_size:
            samples.append(sample)
        if time.perf_counter() - started >= budget and len(per_sample) >= 5:
            break
    wall_s = time.perf_counter() - started
    # Time this thread was ready to run but waited for a core is neither computing nor
    # waiting on I/O: without it, a decode that shares its core with other work reads
    # like a wait on the disk (a busy loop measured 0.29 with 3 processes on 2 cores).
    ran_or_slept_s = wall_s - (_run_queue_wait_s() - queued_started)
    cpu_s = time.process_time() - cpu_started
    cpu_share = min(1.0, cpu_s / ran_or_slept_s) if ran_or_slept_s > 0 else 1.0
    collate_s = None
    if len(samples) == batch_size:
        collate = collate_fn or default_collate
        with contextlib.suppress(Exception):
            collate_s = _median_call(lambda: collate(samples), budget) / batch_size
    batched_s = None
    supports = supports_batched_fetch(dataset)
    if supports:
        fetch = dataset.__getitems__  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            batched_s = _median_call(lambda: fetch(list(indices)), budget) / len(indices)
    return FetchFigures(
        per_sample_s=statistics.median(per_sample),
        cpu_share=cpu_share,
        collate_per_sample_s=collate_s,
        batched_per_sample_s=batched_s,
        supports_batched=supports,
        fill_per_sample_s=_consecutive_s(dataset, length, start=indices[0], budget=budget / 2),
    )


def _consecutive_s(dataset: Dataset, length: int, *, start: int, budget: float) -> float:
    """Mean seconds of ``dataset[i]`` over consecutive indices from ``start`` (wrapping)."""
    count, started = 0, time.perf_counter()
    while count < 5 or (time.perf_counter() - started < budget and count < 4096):
        dataset[(start + count) % length]
        count += 1
    return (time.perf_counter() - started) / count


def _median_call(call: Callable[[], Any], budget: float) -> float:
    times = []
    started = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - started < budget and len(times) < 1000):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
