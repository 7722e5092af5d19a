"""Stage isolation: loader, transfer, compute, per-sample fetch and the pipeline, each alone."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Subset, default_collate

from stoker.config import RunConfig
from stoker.data.device import move_to_device
from stoker.data.loader import PerSampleView
from stoker.train.batch import batch_size_of, forward, split_batch
from stoker.train.optim import build_optimizer
from stoker.train.pipeline import Pipeline, UserComponents, build_train_loader
from stoker.train.precision import build_precision
from stoker.train.session import train_run

__all__ = [
    "FetchFigures",
    "LoaderPoint",
    "PerSampleView",
    "PipelineFigures",
    "Rate",
    "TransferFigures",
    "burst_size",
    "copy_to",
    "loader_overrides",
    "measure_compute",
    "measure_fetch",
    "measure_loader",
    "measure_pipeline",
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
        return self.pageable_gb_per_s * 1e9 / self.batch_bytes * self.batch_size

    @property
    def pinned_samples_per_s(self) -> float | None:
        if self.pinned_gb_per_s is None:
            return None
        return self.pinned_gb_per_s * 1e9 / self.batch_bytes * self.batch_size


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


@dataclass(frozen=True)
class PipelineFigures:
    """A short real training run through stoker's loop.

    ``steady_*`` exclude the loader's start-up (``startup_s``, the first step-level
    window's time beyond the steady rate), which a short run would count as data wait.
    """

    samples_per_s: float
    data_wait_fraction: float
    steps: int
    epoch_s: float
    data_wait_s: float
    startup_s: float
    steady_samples_per_s: float
    steady_data_wait_fraction: float


# --- helpers ---------------------------------------------------------------------------


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def worker_counts(cores: int, configured: int, *, cap: int = 16) -> list[int]:
    """The worker counts the doctor measures: 0, 1, 2, powers of two, cores, cores + 1 (capped).

    The configured count is always included, even above the cap.
    """
    top = max(1, min(cores + 1, cap))
    counts = {0, 1, min(2, top), min(cores, top), top, configured}
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


def supports_batched_fetch(dataset: Dataset) -> bool:
    """Whether the dataset itself defines ``__getitems__`` (a Subset only forwards it)."""
    if isinstance(dataset, Subset):
        return supports_batched_fetch(dataset.dataset)
    return hasattr(type(dataset), "__getitems__")


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
) -> Rate:
    """Iterate ``loader`` with no model for about ``seconds`` and measure samples/s.

    The first ``warmup_batches`` (worker start-up, prefetched batches) are not measured.
    When an epoch ends a new one starts, and its start-up counts, as in training.
    Workers finish out of order and the loader hands batches out in order, so up to
    ``burst`` (workers x prefetch) can arrive at once: the measurement runs on (up to
    ``3 * seconds + 2``) until it holds two bursts, and each of the ``repeats`` groups
    (median reported) holds at least one, so a burst cannot pass for a rate.
    ``consume`` is applied to each measured batch (e.g. the copy to the GPU).
    """
    min_batches = max(2 * repeats, 2 * burst)
    started = time.perf_counter()
    first_batch_s = None
    iterator: Iterator[Any] = iter(loader)
    try:
        taken = empty_passes = 0
        while taken < max(1, warmup_batches):
            try:
                next(iterator)
            except StopIteration:
                empty_passes += 1 if taken == 0 else 0
                if empty_passes > 1:
                    return Rate(0.0, (), 0.0, time.perf_counter() - started, 0, 0.0)
                iterator = iter(loader)
                continue
            if first_batch_s is None:
                first_batch_s = time.perf_counter() - started
            taken += 1
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
        groups = max(1, min(repeats, len(arrivals) // burst))
        rate = grouped_rate(arrivals, start=start, repeats=groups, warmup_s=warmup_s)
        return dataclasses.replace(rate, first_batch_s=first_batch_s or 0.0)
    finally:
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
        del iterator
        release_loader(loader)


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
        loader = build_train_loader(
            config,
            pipeline.train_data,
            device=pipeline.device,
            collate_fn=pipeline.collate_fn,
            **loader_overrides(
                count,
                prefetch_factor=loader_cfg.prefetch_factor,
                persistent_workers=loader_cfg.persistent_workers,
            ),
        )
        rate = measure_loader(
            loader,
            seconds=seconds,
            repeats=repeats,
            warmup_batches=warmup_batches(count, loader_cfg.prefetch_factor),
            burst=burst_size(count, loader_cfg.prefetch_factor),
        )
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


def measure_compute(
    model: torch.nn.Module,
    batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    config: RunConfig,
    device: torch.device,
    seconds: float,
    repeats: int = 3,
) -> Rate:
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

    def step() -> None:
        with precision.autocast():
            loss = loss_fn(forward(model, inputs), targets)
        precision.backward(loss)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

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
    return grouped_rate(arrivals, start=start, repeats=repeats, warmup_s=start - warm_started)


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
    )


def _median_call(call: Callable[[], Any], budget: float) -> float:
    times = []
    started = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - started < budget and len(times) < 1000):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- (d) the pipeline: a short real run ------------------------------------------------


def pipeline_steps(*, seconds: float, expected_samples_per_s: float, batch_size: int) -> int:
    """Steps for a pipeline run of about ``seconds`` at the expected rate (3 to 100,000)."""
    if not math.isfinite(expected_samples_per_s) or expected_samples_per_s <= 0:
        return 10
    return int(min(max(math.ceil(seconds * expected_samples_per_s / batch_size), 3), 100_000))


def short_run_config(
    config: RunConfig, *, steps: int, epochs: int, run_dir: Path, log_every: int
) -> RunConfig:
    """``config`` for a short measured run: no checkpoints, no TensorBoard, no validation."""
    train = config.train.model_copy(
        update={
            "max_steps": steps,
            "epochs": epochs,
            "monitor": "train/loss",
            "early_stopping": None,
            "log_every_steps": log_every,
        }
    )
    return config.model_copy(
        update={
            "train": train,
            "checkpoint": config.checkpoint.model_copy(update={"enabled": False}),
            "tracking": config.tracking.model_copy(
                update={"tensorboard": False, "run_dir": str(run_dir)}
            ),
        }
    )


def _step_windows(metrics_path: Path) -> dict[int, list[float]]:
    """Step-level throughputs of a run, per epoch, in order (epoch records left out)."""
    windows: dict[int, list[float]] = {}
    if not metrics_path.is_file():
        return windows
    for line in metrics_path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if "time/epoch_s" in record or "throughput/samples_per_s" not in record:
                continue
            rate = record["throughput/samples_per_s"]
            if isinstance(rate, (int, float)) and rate > 0:
                windows.setdefault(int(record.get("epoch", 0)), []).append(float(rate))
    return windows


def warmup_steps(config: RunConfig) -> int:
    """Steps of a run before its loader is steady: start-up plus the prefetched burst."""
    loader = config.loader
    batches = warmup_batches(loader.num_workers, loader.prefetch_factor)
    return math.ceil(batches / config.train.grad_accum_steps)


def measure_pipeline(
    config: RunConfig,
    pipeline: Pipeline,
    model: torch.nn.Module,
    *,
    steps: int,
    dataset: Dataset | None = None,
) -> PipelineFigures:
    """Train ``steps`` steps (over as many epochs as that takes) with stoker's own loop.

    ``config``'s loader settings are the ones measured; the pipeline's data (or
    ``dataset``), loss and collate are reused; ``model`` is deep-copied. The loop logs
    step-level windows; those within :func:`warmup_steps` of an epoch's start hold the
    loader's start-up and prefetched burst. The windows after them give the steady rate,
    and the early windows' time beyond that rate is start-up, taken out of ``steady_*``.
    """
    data = dataset if dataset is not None else pipeline.train_data
    step_samples = config.loader.batch_size * config.train.grad_accum_steps
    try:
        batches = len(data) / config.loader.batch_size  # type: ignore[arg-type]
        batches = math.floor(batches) if config.loader.drop_last else math.ceil(batches)
        per_epoch = max(1, math.ceil(batches / config.train.grad_accum_steps))
    except TypeError:
        per_epoch = steps
    epochs = min(max(1, math.ceil(steps / per_epoch)), 1000)
    skip = warmup_steps(config)
    # About eight windows per epoch: a record (a sync and a line written) is no per-step cost.
    log_every = max(1, min(steps, per_epoch) // 8)
    user = UserComponents(
        model=copy.deepcopy(model),
        train_data=data,
        val_data=None,
        loss_fn=pipeline.loss_fn,
        collate_fn=pipeline.collate_fn,
    )
    with tempfile.TemporaryDirectory(prefix="stoker-doctor-") as tmp:
        run_dir = Path(tmp) / "run"
        short = short_run_config(
            config, steps=steps, epochs=epochs, run_dir=run_dir, log_every=log_every
        )
        history = train_run(short, user=user, progress="quiet").history
        windows = _step_windows(run_dir / "metrics.jsonl")
    epoch_s = sum(float(r["time/epoch_s"]) for r in history)
    wait_s = sum(float(r["time/data_wait_s"]) for r in history)
    samples = sum(float(r["throughput/samples_per_s"]) * float(r["time/epoch_s"]) for r in history)
    rate = samples / epoch_s if epoch_s > 0 else 0.0
    # Windows hold equal samples, so the steady rate is their count over their time.
    window_samples = log_every * step_samples
    steady = [w for epoch in windows.values() for k, w in enumerate(epoch) if k * log_every >= skip]
    early = [w for epoch in windows.values() for k, w in enumerate(epoch) if k * log_every < skip]
    steady_rate = len(steady) / sum(1 / w for w in steady) if steady else rate
    startup = 0.0
    if steady and steady_rate > 0:
        startup = max(0.0, sum(window_samples / w - window_samples / steady_rate for w in early))
    startup = min(startup, wait_s, 0.5 * epoch_s)
    steady_s = epoch_s - startup
    return PipelineFigures(
        samples_per_s=rate,
        data_wait_fraction=wait_s / epoch_s if epoch_s > 0 else 0.0,
        steps=int(history[-1]["step"]) if history else 0,
        epoch_s=epoch_s,
        data_wait_s=wait_s,
        startup_s=startup,
        steady_samples_per_s=steady_rate,
        steady_data_wait_fraction=max(0.0, (wait_s - startup) / steady_s) if steady_s > 0 else 0.0,
    )


def planned_pipeline_steps(
    config: RunConfig,
    pipeline: Pipeline,
    model: torch.nn.Module,
    *,
    seconds: float,
    expected_samples_per_s: float,
    dataset: Dataset | None = None,
) -> int:
    """Steps for a pipeline run of about ``seconds``: the stage ceilings' guess, or when
    that is many steps, a short calibration run's (the loop's own cost shows there)."""
    batch = config.loader.batch_size * config.train.grad_accum_steps
    # Enough steps past the loader's warm-up for several bursts of prefetched batches.
    burst = math.ceil(
        burst_size(config.loader.num_workers, config.loader.prefetch_factor)
        / config.train.grad_accum_steps
    )
    least = warmup_steps(config) + 2 * burst + 4
    guess = pipeline_steps(
        seconds=seconds, expected_samples_per_s=expected_samples_per_s, batch_size=batch
    )
    if guess > 50:
        trial = measure_pipeline(
            config, pipeline, model, steps=max(16, least, guess // 20), dataset=dataset
        )
        guess = pipeline_steps(
            seconds=seconds, expected_samples_per_s=trial.steady_samples_per_s, batch_size=batch
        )
    return max(guess, least)
