"""Stage isolation: the loader, transfer, compute and per-sample fetch, each measured alone
(the pipeline as a whole is measured by :mod:`stoker.observe.short_run`)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from stoker.config import RunConfig
from stoker.data.device import move_to_device
from stoker.data.loader import PerSampleView
from stoker.observe.fetch_cost import FetchFigures, measure_fetch, supports_batched_fetch
from stoker.train.batch import batch_size_of, forward, split_batch
from stoker.train.optim import build_optimizer
from stoker.train.pipeline import Pipeline, build_train_loader
from stoker.train.precision import build_precision

__all__ = [
    "ComputeFigures",
    "FetchFigures",
    "LoaderPoint",
    "PerSampleView",
    "Rate",
    "TransferFigures",
    "burst_size",
    "copy_to",
    "loader_overrides",
    "measure_compute",
    "measure_fetch",
    "measure_loader",
    "measure_transfer",
    "release_loader",
    "supports_batched_fetch",
    "usable_cores",
    "warmup_batches",
    "worker_counts",
]


@dataclass(frozen=True)
class Rate:
    """A throughput: the median of ``repeats``, the rates of consecutive groups of batches.

    ``seconds`` and ``batches`` are what was measured after ``warmup_s`` of warm-up;
    ``first_batch_s`` is a loader's time to its first batch (its start-up).
    """

    samples_per_s: float
    repeats: tuple[float, ...]
    seconds: float
    warmup_s: float
    batches: int
    first_batch_s: float = 0.0


@dataclass(frozen=True)
class LoaderPoint:
    """The training loader alone (no model) at one worker count."""

    num_workers: int
    samples_per_s: float
    startup_s: float
    repeats: tuple[float, ...]


@dataclass(frozen=True)
class TransferFigures:
    """Host-to-device copies of one representative batch, pageable and pinned."""

    batch_bytes: int
    batch_size: int
    pageable_gb_per_s: float
    pinned_gb_per_s: float | None

    @property
    def pageable_samples_per_s(self) -> float:
        """The samples/s the host-to-device copy allows from ordinary (pageable) memory."""
        return self.pageable_gb_per_s * 1e9 / self.batch_bytes * self.batch_size

    @property
    def pinned_samples_per_s(self) -> float | None:
        """The same from pinned memory; None when pinning was not measured."""
        if self.pinned_gb_per_s is None:
            return None
        return self.pinned_gb_per_s * 1e9 / self.batch_bytes * self.batch_size


# --- helpers ---------------------------------------------------------------------------


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def worker_counts(
    cores: int, configured: int, *, cap: int = 16, cpu_share: float | None = None
) -> list[int]:
    """The worker counts the doctor measures: 0, 1, 2, powers of two, cores, cores + 1 (capped).

    A fetch that mostly waits (``cpu_share`` below one half: disk, network) leaves its
    core idle, so more workers than cores still overlap their waits: the sweep then goes
    on in powers of two up to the cores over the CPU share (capped). The configured count
    is always included, even above the cap.
    """
    top = max(1, min(cores + 1, cap))
    if cpu_share is not None and cpu_share < 0.5:
        top = max(top, min(cap, math.ceil(cores / max(cpu_share, 1 / 64))))
    counts = {0, 1, min(2, top), min(cores, top), min(cores + 1, top), top, configured}
    power = 4
    while power < top:
        counts.add(power)
        power *= 2
    return sorted(counts)


def loader_overrides(
    num_workers: int, *, prefetch_factor: int | None, persistent_workers: bool
) -> dict[str, Any]:
    """Overrides for ``build_train_loader``: worker-only knobs are dropped at 0 workers."""
    workers = num_workers > 0
    return {
        "num_workers": num_workers,
        "prefetch_factor": prefetch_factor if workers else None,
        "persistent_workers": persistent_workers and workers,
    }


def warmup_batches(num_workers: int, prefetch_factor: int | None) -> int:
    """Batches taken before measuring: until the prefetched ones are drained, batches
    arrive faster than the workers make them."""
    return num_workers * ((prefetch_factor or 2) + 1) if num_workers else 1


def burst_size(num_workers: int, prefetch_factor: int | None) -> int:
    """The most batches a loader can hand out at once (all its workers' finished ones)."""
    return max(1, num_workers * (prefetch_factor or 2))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    values = obj.values() if isinstance(obj, Mapping) else obj
    if isinstance(values, (list, tuple)) or isinstance(obj, Mapping):
        return [t for item in values for t in _tensors(item)]
    return []


def samples_in(batch: Any) -> int:
    """Samples in a batch: its targets' length, else the first tensor's first dimension."""
    with contextlib.suppress(Exception):
        return batch_size_of(split_batch(batch)[1])
    shaped = [t for t in _tensors(batch) if t.ndim > 0]
    return int(shaped[0].shape[0]) if shaped else 1


def grouped_rate(
    arrivals: Sequence[tuple[float, int]], *, start: float, repeats: int, warmup_s: float
) -> Rate:
    """The median rate over ``repeats`` consecutive groups of (time, samples) arrivals."""
    if not arrivals:
        return Rate(0.0, (), 0.0, warmup_s, 0)
    groups = max(1, min(repeats, len(arrivals)))
    rates: list[float] = []
    previous = start
    for g in range(groups):
        part = arrivals[len(arrivals) * g // groups : len(arrivals) * (g + 1) // groups]
        end = part[-1][0]
        samples = sum(n for _, n in part)
        rates.append(samples / (end - previous) if end > previous else math.inf)
        previous = end
    finite = [r for r in rates if math.isfinite(r)] or [0.0]
    return Rate(
        samples_per_s=statistics.median(finite),
        repeats=tuple(rates),
        seconds=arrivals[-1][0] - start,
        warmup_s=warmup_s,
        batches=len(arrivals),
    )


def release_loader(loader: Any) -> None:
    """Shut down a loader's persistent workers now, not when garbage collection gets to it."""
    dataloader = getattr(loader, "dataloader", loader)
    iterator = getattr(dataloader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
        dataloader._iterator = None


# --- (a) the loader alone --------------------------------------------------------------


def measure_loader(
    loader: Iterable[Any],
    *,
    seconds: float,
    repeats: int = 3,
    warmup_batches: int = 1,
    burst: int = 1,
    consume: Callable[[Any], Any] | None = None,
    max_s: float | None = None,
) -> Rate:
    """Iterate ``loader`` with no model for about ``seconds`` and measure samples/s.

    The first ``warmup_batches`` (worker start-up, prefetched batches) are not measured.
    When an epoch ends a new one starts, and its start-up counts, as in training.
    Workers finish out of order and the loader hands batches out in order, so up to
    ``burst`` (workers x prefetch) can arrive at once: the measurement runs on (up to
    ``3 * seconds + 2``) until it holds two bursts, and each of the ``repeats`` groups
    (median reported) holds at least one, so a burst cannot pass for a rate.
    ``consume`` is applied to each measured batch (e.g. the copy to the GPU).
    ``max_s`` bounds the whole measurement, warm-up included (a tuner's budget): past it
    the warm-up ends early and the rate is taken from what arrived (at least one batch).
    """
    min_batches = max(2 * repeats, 2 * burst)
    started = time.perf_counter()
    first_batch_s = None
    iterator: Iterator[Any] = iter(loader)
    try:
        taken = empty_passes = warm_samples = 0
        while taken < max(1, warmup_batches):
            if taken and max_s is not None and time.perf_counter() - started >= 0.5 * max_s:
                break
            try:
                batch = next(iterator)
            except StopIteration:
                empty_passes += 1 if taken == 0 else 0
                if empty_passes > 1:
                    return Rate(0.0, (), 0.0, time.perf_counter() - started, 0, 0.0)
                iterator = iter(loader)
                continue
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - started
            taken += 1
            warm_samples += samples_in(batch)
        start = time.perf_counter()
        warmup_s = start - started
        arrivals: list[tuple[float, int]] = []
        fresh = False
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                if fresh:  # a new pass yielded nothing: the loader is empty from here on
                    break
                iterator, fresh = iter(loader), True
                continue
            fresh = False
            if consume is not None:
                consume(batch)
            now = time.perf_counter()
            arrivals.append((now, samples_in(batch)))
            elapsed = now - start
            if elapsed >= seconds and len(arrivals) >= min_batches:
                break
            if elapsed >= 3 * seconds + 2 and len(arrivals) >= 1:
                break
            if max_s is not None and now - started >= max_s and len(arrivals) >= 1:
                if len(arrivals) < min_batches:
                    # Cut short within a burst of prefetched batches: only the whole span,
                    # start-up included, is a rate (a low one, never a burst's).
                    samples = warm_samples + sum(n for _, n in arrivals)
                    whole = samples / (now - started)
                    return Rate(whole, (whole,), now - start, warmup_s, len(arrivals), 0.0)
                break
        groups = max(1, min(repeats, len(arrivals) // burst))
        rate = grouped_rate(arrivals, start=start, repeats=groups, warmup_s=warmup_s)
        return dataclasses.replace(rate, first_batch_s=first_batch_s or 0.0)
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
        del iterator
        release_loader(loader)


def time_train_loader(
    config: RunConfig,
    pipeline: Pipeline,
    overrides: dict[str, Any],
    *,
    data: Any = None,
    seconds: float,
    repeats: int = 3,
    **measure: Any,
) -> Rate:
    """The run's training loader alone, built with ``overrides`` (``loader_overrides``,
    ``Candidate.overrides``) over ``data`` (default: the run's), timed by
    ``measure_loader`` past its workers' prefetched batches; ``measure``: its other
    options (``consume``, ``max_s``)."""
    loader = build_train_loader(
        config,
        pipeline.train_data if data is None else data,
        device=pipeline.device,
        collate_fn=pipeline.collate_fn,
        **overrides,
    )
    workers, prefetch = overrides["num_workers"], overrides["prefetch_factor"]
    return measure_loader(
        loader,
        seconds=seconds,
        repeats=repeats,
        warmup_batches=warmup_batches(workers, prefetch),
        burst=burst_size(workers, prefetch),
        **measure,
    )


def sweep_workers(
    config: RunConfig,
    pipeline: Pipeline,
    counts: Sequence[int],
    *,
    seconds: float,
    repeats: int = 3,
) -> list[LoaderPoint]:
    """The training loader alone at each worker count (other knobs as configured)."""
    loader_cfg = config.loader
    points = []
    for count in counts:
        overrides = loader_overrides(
            count,
            prefetch_factor=loader_cfg.prefetch_factor,
            persistent_workers=loader_cfg.persistent_workers,
        )
        rate = time_train_loader(config, pipeline, overrides, seconds=seconds, repeats=repeats)
        points.append(
            LoaderPoint(
                num_workers=count,
                samples_per_s=rate.samples_per_s,
                startup_s=rate.first_batch_s,
                repeats=rate.repeats,
            )
        )
    return points


def first_batch(config: RunConfig, pipeline: Pipeline) -> Any:
    """One real training batch, loaded in the main process (no workers started)."""
    overrides = loader_overrides(0, prefetch_factor=None, persistent_workers=False)
    data, device, collate = pipeline.train_data, pipeline.device, pipeline.collate_fn
    loader = build_train_loader(
        config, data, device=device, collate_fn=collate, pin_memory=False, **overrides
    )
    return next(iter(loader))


# --- (b) host-to-device transfer alone -------------------------------------------------


def copy_to(device: torch.device) -> Callable[[Any], None] | None:
    """A batch's copy to ``device``, finished before it returns; None for the CPU."""
    if device.type == "cpu":
        return None

    def copy(batch: Any) -> None:
        move_to_device(batch, device, non_blocking=True)
        _synchronize(device)

    return copy


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU–GPU sync point: the copies must be done.
    elif device.type == "mps":
        torch.mps.synchronize()


def _copy_rate(batch: Any, device: torch.device, *, seconds: float, non_blocking: bool) -> float:
    """Copies per second of ``batch`` to ``device`` (median over 3 timed groups)."""
    for _ in range(3):  # warm-up: allocator, context
        move_to_device(batch, device, non_blocking=non_blocking)
    _synchronize(device)
    rates = []
    for _ in range(3):
        copies = 0
        started = time.perf_counter()
        while True:
            move_to_device(batch, device, non_blocking=non_blocking)
            copies += 1
            if copies % 8 == 0 and time.perf_counter() - started >= seconds / 3:
                break
        _synchronize(device)
        rates.append(copies / (time.perf_counter() - started))
    return statistics.median(rates)


def measure_transfer(batch: Any, device: torch.device, *, seconds: float) -> TransferFigures | None:
    """GB/s of host-to-device copies of ``batch``, pageable and pinned; None on the CPU."""
    size = sum(t.numel() * t.element_size() for t in _tensors(batch))
    if device.type == "cpu" or size == 0:
        return None
    samples = samples_in(batch)
    pageable = _copy_rate(batch, device, seconds=seconds / 2, non_blocking=False) * size / 1e9
    pinned = None
    if device.type == "cuda":
        from torch.utils.data._utils.pin_memory import pin_memory

        pinned_batch = pin_memory(batch)
        pinned = _copy_rate(pinned_batch, device, seconds=seconds / 2, non_blocking=True)
        pinned = pinned * size / 1e9
    return TransferFigures(
        batch_bytes=size, batch_size=samples, pageable_gb_per_s=pageable, pinned_gb_per_s=pinned
    )


# --- (c) compute alone -----------------------------------------------------------------


@dataclass(frozen=True)
class ComputeFigures:
    """Compute alone: the rate, and each phase's share of a step (``forward`` includes
    the loss), timed on a separate pass with a sync after each phase."""

    samples_per_s: float
    repeats: tuple[float, ...]
    forward_share: float
    backward_share: float
    optimizer_share: float


def measure_compute(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    config: RunConfig,
    device: torch.device,
    seconds: float,
    repeats: int = 3,
) -> ComputeFigures:
    """Forward, loss, backward and optimizer step on one batch already on the device.

    ``model`` is deep-copied, so the caller's copy is not trained.
    """
    model = copy.deepcopy(model).to(device)
    model.train()
    optimizer = build_optimizer(model, config.optim, device=device)
    # The same batch again and again would train the weights into denormal numbers, which
    # are many times slower on CPUs; with lr 0 every step does the same work as a fresh one.
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    precision = build_precision(config.train, device)
    inputs, targets = split_batch(move_to_device(batch, device, non_blocking=False))
    size = samples_in(batch)
    phase_s = [0.0, 0.0, 0.0]

    def step(timed: bool = False) -> None:
        t0 = time.perf_counter()
        with precision.autocast():
            loss = loss_fn(forward(model, inputs), targets)
        if timed:
            _synchronize(device)
        t1 = time.perf_counter()
        precision.backward(loss)
        if timed:
            _synchronize(device)
        t2 = time.perf_counter()
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        if timed:
            _synchronize(device)
            t3 = time.perf_counter()
            phase_s[0] += t1 - t0
            phase_s[1] += t2 - t1
            phase_s[2] += t3 - t2

    warm_started = time.perf_counter()
    for _ in range(3):  # optimizer state, allocator, kernels chosen
        step()
    _synchronize(device)
    arrivals: list[tuple[float, int]] = []
    start = time.perf_counter()
    for _ in range(max(repeats, 1)):
        group_started, steps = time.perf_counter(), 0
        while steps < 2 or time.perf_counter() - group_started < seconds / max(repeats, 1):
            step()
            steps += 1
        _synchronize(device)
        arrivals.append((time.perf_counter(), steps * size))
    rate = grouped_rate(arrivals, start=start, repeats=repeats, warmup_s=start - warm_started)
    # The phase split on its own pass (a sync per phase would slow the rate above).
    timed_started = time.perf_counter()
    while time.perf_counter() - timed_started < max(seconds / 4, 0.02) or phase_s[0] == 0:
        step(timed=True)
    total = sum(phase_s) or 1.0
    return ComputeFigures(
        samples_per_s=rate.samples_per_s,
        repeats=rate.repeats,
        forward_share=phase_s[0] / total,
        backward_share=phase_s[1] / total,
        optimizer_share=phase_s[2] / total,
    )
