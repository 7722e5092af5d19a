"""Short real training runs through stoker's loop: the pipeline as measured, with or without
a change applied (the doctor's confirmation and the tuner's prediction both come from here)."""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import math
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from stoker.config import RunConfig
from stoker.data.cache import CachedDataset
from stoker.data.sources import ArrayDataset, length_or_none
from stoker.observe.stages import burst_size, warmup_batches
from stoker.train.pipeline import Pipeline, UserComponents, cached_train_data
from stoker.train.session import train_run

__all__ = [
    "PipelineFigures",
    "apply_settings",
    "measure_pipeline",
    "pipeline_steps",
    "planned_pipeline_steps",
    "short_run_config",
    "startup_wait",
    "threads",
    "warmup_steps",
]

#: The settings key of the intra-op thread count (``torch.set_num_threads``).
THREADS_KEY = "train.threads"


@dataclass(frozen=True)
class PipelineFigures:
    """A short real training run through stoker's loop.

    ``steady_*`` exclude the loader's start-up (``startup_s``): the first windows' time
    beyond the steady rate, at most the loader's own measured time to its first batch
    per epoch, so a stall that lasts the whole run is never taken for start-up.
    ``phases`` holds each phase's share of the run's step time (``forward``,
    ``backward``, ``optimizer``, ``data_wait``, ``transfer``): the run's own phase table.
    ``epoch_samples`` is a whole epoch of the configured data (0 for a stream).
    ``epoch_times`` holds each epoch's time when the run trained whole epochs (each
    ended by its data, as a real run's do: worker start-up and shutdown inside);
    ``persistent`` whether its workers outlive an epoch; ``threads`` the intra-op thread
    count it ran with; ``cut_short`` whether a deadline stopped it (its rates are then
    the steps it took over its time, nothing more).
    """

    samples_per_s: float
    data_wait_fraction: float
    steps: int
    epoch_s: float
    data_wait_s: float
    startup_s: float
    steady_samples_per_s: float
    steady_data_wait_fraction: float
    phases: dict[str, float] = field(default_factory=dict)
    epoch_samples: int = 0
    epochs: int = 1
    wall_s: float = 0.0
    prepare_s: float = 0.0
    epoch_times: tuple[float, ...] = ()
    persistent: bool = False
    threads: int = 0
    cut_short: bool = False

    def run_rate(self, epochs: int, samples: int | None = None) -> float:
        """Samples/s over a run of ``epochs`` whole epochs, ``prepare_s`` (filling a
        cache) paid once before the first: what a real run of that many epochs shows.

        With whole epochs measured, their own times: the first ``epochs`` of them, or
        when fewer were run, the later epochs at the later ones' mean (persistent
        workers start once, in the first) or, with one epoch, at the first less its
        start-up when the workers persist. Otherwise the steady rate with each epoch's
        start-up paid (:meth:`epoch_rate`)."""
        if self.epoch_times and self.epoch_samples > 0 and samples in (None, self.epoch_samples):
            return epochs * self.epoch_samples / (self.prepare_s + self.run_s(epochs))
        samples = samples or self.epoch_samples
        rate = self.epoch_rate(samples)
        if samples <= 0 or rate <= 0:
            return rate
        return epochs * samples / (self.prepare_s + epochs * samples / rate)

    def run_s(self, epochs: int) -> float:
        """Seconds of ``epochs`` whole epochs, from the epochs measured (see run_rate)."""
        times = self.epoch_times
        if len(times) >= epochs:
            return sum(times[:epochs])
        if len(times) > 1:
            later = sum(times[1:]) / (len(times) - 1)
        else:
            later = times[0] - (self.epoch_startup_s if self.persistent else 0.0)
        return sum(times) + (epochs - len(times)) * max(later, 0.0)

    def epoch_rate(self, samples: int | None = None) -> float:
        """Samples/s over a whole epoch of ``samples`` (default: the data's): the steady
        rate with the epoch's start-up paid once, as a real run pays it."""
        samples = samples or self.epoch_samples
        steady = self.steady_samples_per_s
        if samples <= 0 or steady <= 0:
            return steady
        return samples / (self.epoch_startup_s + samples / steady)

    @property
    def epoch_startup_s(self) -> float:
        """What an epoch of the short run took beyond its samples at the steady rate:
        worker start-up, first batches, warm-up. Not capped as ``startup_s`` is (that
        one guards the steady data wait; this one is what a real epoch pays again)."""
        if self.steady_samples_per_s <= 0:
            return 0.0
        beyond = self.epoch_s - self.samples_per_s * self.epoch_s / self.steady_samples_per_s
        return max(0.0, beyond) / max(self.epochs, 1)


# --- applying settings -----------------------------------------------------------------


def apply_settings(config: RunConfig, settings: Mapping[str, Any]) -> RunConfig:
    """``config`` with dotted ``section.key`` settings applied (``train.threads`` aside:
    see :func:`threads`; it is applied to the config only where the config has it)."""
    sections: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, _, name = key.partition(".")
        if key == THREADS_KEY and name not in type(config.train).model_fields:
            continue
        sections.setdefault(section, {})[name] = value
    update = {
        section: getattr(config, section).model_copy(update=values)
        for section, values in sections.items()
    }
    return config.model_copy(update=update)


@contextlib.contextmanager
def threads(count: int | None) -> Iterator[None]:
    """``torch.set_num_threads(count)`` for the block, the previous count restored after."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(count)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cached_data(config: RunConfig, dataset: Dataset) -> tuple[Dataset, float]:
    """``dataset`` behind a memory cache when ``config`` asks for one and it has none yet,
    made as ``build_pipeline`` makes it (read once into arrays when it can be, else a
    per-sample cache) and filled at once, and the seconds that took: a short run sees
    every epoch cached, and the fill is reported apart (a real run pays it once)."""
    if config.data.cache != "memory" or isinstance(dataset, (CachedDataset, ArrayDataset)):
        return dataset, 0.0
    started = time.perf_counter()
    cached = cached_train_data(config, dataset)
    if isinstance(cached, CachedDataset):
        cached.warm()
    return cached, time.perf_counter() - started


# --- the run ---------------------------------------------------------------------------


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


def _epoch_samples(data: Dataset, config: RunConfig) -> int:
    try:
        length = len(data)  # type: ignore[arg-type]
    except TypeError:
        return 0
    if config.loader.drop_last:
        return length // config.loader.batch_size * config.loader.batch_size
    return length


def measure_pipeline(
    config: RunConfig,
    pipeline: Pipeline,
    model: torch.nn.Module,
    *,
    steps: int,
    dataset: Dataset | None = None,
    loader_startup_s: float | None = None,
    thread_count: int | None = None,
    deadline: float | None = None,
    min_steps: int = 0,
) -> PipelineFigures:
    """Train ``steps`` steps (over as many epochs as that takes) with stoker's own loop.

    When ``steps`` is a whole number of epochs, the run trains those epochs to the end
    of their data (no step limit), so each epoch's time holds what a real one does:
    worker start-up, the last batches, the workers' shutdown (``epoch_times``).
    A ``deadline`` (``time.perf_counter()``) stops the run after the step that passes
    it, though not before ``min_steps``; such a run is ``cut_short``.

    ``config``'s loader, optimizer and data settings are the ones measured; the
    pipeline's data (or ``dataset``), loss and collate are reused; ``model`` is
    deep-copied. The loop logs step-level windows; those within :func:`warmup_steps` of
    an epoch's start hold the loader's start-up and prefetched burst. The windows after
    them give the steady rate; the early windows' time beyond that rate is start-up,
    taken out of ``steady_*`` up to ``loader_startup_s`` per epoch (the loader's own time
    to its first batch, when measured) and never beyond the data wait measured.
    ``thread_count`` runs it at that many intra-op threads.
    """
    started = time.perf_counter()
    data, prepare_s = cached_data(config, dataset if dataset is not None else pipeline.train_data)
    step_samples = config.loader.batch_size * config.train.grad_accum_steps
    try:
        batches = len(data) / config.loader.batch_size  # type: ignore[arg-type]
        batches = math.floor(batches) if config.loader.drop_last else math.ceil(batches)
        per_epoch = max(1, math.ceil(batches / config.train.grad_accum_steps))
    except TypeError:
        per_epoch = steps
    epochs = min(max(1, math.ceil(steps / per_epoch)), 1000)
    whole = length_or_none(data) is not None and epochs * per_epoch == steps
    skip = warmup_steps(config)
    # About eight windows per epoch: a record (a sync and a line written) is no per-step cost.
    log_every = max(1, min(steps, per_epoch) // 8)
    stop = _Deadline(deadline, step_samples, min_steps=min_steps)
    user = UserComponents(
        model=copy.deepcopy(model),
        train_data=data,
        val_data=None,
        loss_fn=pipeline.loss_fn,
        collate_fn=pipeline.collate_fn,
        callbacks=(stop,) if deadline is not None else (),
    )
    # The data is handed over already cached: build_pipeline must not wrap it again.
    plain = config.model_copy(update={"data": config.data.model_copy(update={"cache": "none"})})
    with tempfile.TemporaryDirectory(prefix="stoker-doctor-") as tmp, threads(thread_count):
        run_dir = Path(tmp) / "run"
        short = short_run_config(
            plain, steps=steps, epochs=epochs, run_dir=run_dir, log_every=log_every
        )
        if whole:  # ended by the data, as a real run's epochs are
            short = short.model_copy(
                update={"train": short.train.model_copy(update={"max_steps": None})}
            )
        history = train_run(short, user=user, progress="quiet").history
        windows = _step_windows(run_dir / "metrics.jsonl")
        ran_threads = _threads_used(run_dir / "environment.json")
        # A loader with persistent workers can outlive the run in a reference cycle; its
        # workers are stopped here, in this run's time, not in the middle of a later one.
        gc.collect()
    if stop.stopped:
        return stop.figures(config, data, wall_s=time.perf_counter() - started, threads=ran_threads)
    epoch_s = sum(float(r["time/epoch_s"]) for r in history)
    wait_s = sum(float(r["time/data_wait_s"]) for r in history)
    samples = sum(float(r["throughput/samples_per_s"]) * float(r["time/epoch_s"]) for r in history)
    rate = samples / epoch_s if epoch_s > 0 else 0.0
    # Windows hold equal samples, so the steady rate is their count over their time.
    window_samples = log_every * step_samples
    steady = [w for epoch in windows.values() for k, w in enumerate(epoch) if k * log_every >= skip]
    early = [w for epoch in windows.values() for k, w in enumerate(epoch) if k * log_every < skip]
    steady_rate = len(steady) / sum(1 / w for w in steady) if steady else rate
    excess = 0.0
    if steady and steady_rate > 0:
        excess = max(0.0, sum(window_samples / w - window_samples / steady_rate for w in early))
    startup = startup_wait(
        excess_s=excess,
        loader_startup_s=loader_startup_s,
        epochs=len(history),
        wait_s=wait_s,
        run_s=epoch_s,
    )
    steady_s = epoch_s - startup
    totals = {
        phase: sum(float(r.get(f"time/{phase}_s", 0.0)) for r in history)
        for phase in ("data_wait", "transfer", "forward", "backward", "optimizer")
    }
    measured = sum(totals.values())
    return PipelineFigures(
        samples_per_s=rate,
        data_wait_fraction=wait_s / epoch_s if epoch_s > 0 else 0.0,
        steps=int(history[-1]["step"]) if history else 0,
        epoch_s=epoch_s,
        data_wait_s=wait_s,
        startup_s=startup,
        steady_samples_per_s=steady_rate,
        steady_data_wait_fraction=max(0.0, (wait_s - startup) / steady_s) if steady_s > 0 else 0.0,
        phases={k: v / measured for k, v in totals.items()} if measured > 0 else {},
        epoch_samples=_epoch_samples(data, config),
        epochs=max(1, len(history)),
        wall_s=time.perf_counter() - started,
        prepare_s=prepare_s,
        epoch_times=tuple(float(r["time/epoch_s"]) for r in history) if whole else (),
        persistent=config.loader.persistent_workers and config.loader.num_workers > 0,
        threads=ran_threads,
    )


def _threads_used(path: Path) -> int:
    """The intra-op thread count a run recorded in its environment.json (0: unknown)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        return int(json.loads(path.read_text()).get("torch_threads", 0))
    return 0


class _Deadline:
    """A callback that stops a short run after the step that passes ``at``, counting
    the steps and samples it saw (what is left of a run cut short)."""

    def __init__(self, at: float | None, step_samples: int, *, min_steps: int = 0) -> None:
        self.at = at
        self.min_steps = min_steps
        self.step_samples = step_samples
        self.steps = 0
        self.started = 0.0
        self.elapsed = 0.0
        self.stopped = False

    def on_train_start(self, loop: Any) -> None:
        self.started = time.perf_counter()

    def on_step_end(self, loop: Any, step: Any) -> None:
        self.steps += 1
        late = self.at is not None and time.perf_counter() >= self.at
        if late and self.steps >= self.min_steps:
            self.stopped = True
            loop.request_stop("the tuner's deadline")
        self.elapsed = time.perf_counter() - self.started

    def figures(
        self, config: RunConfig, data: Dataset, *, wall_s: float, threads: int
    ) -> PipelineFigures:
        elapsed = max(self.elapsed, 1e-9)
        rate = self.steps * self.step_samples / elapsed
        return PipelineFigures(
            samples_per_s=rate,
            data_wait_fraction=0.0,
            steps=self.steps,
            epoch_s=elapsed,
            data_wait_s=0.0,
            startup_s=0.0,
            steady_samples_per_s=rate,
            steady_data_wait_fraction=0.0,
            epoch_samples=_epoch_samples(data, config),
            wall_s=wall_s,
            threads=threads,
            cut_short=True,
        )


def startup_wait(
    *, excess_s: float, loader_startup_s: float | None, epochs: int, wait_s: float, run_s: float
) -> float:
    """The data wait a short run counts as the loader's start-up (left out of ``steady_*``).

    ``excess_s`` is the early windows' time beyond the steady rate. It also holds the
    model's own warm-up (allocator, first kernels), which is no data wait: only up to the
    loader's measured time to its first batch per epoch is taken, never more than the data
    wait measured nor half the run, so a stall that lasts the whole run stays in it.
    """
    startup = excess_s
    if loader_startup_s is not None:
        startup = min(startup, loader_startup_s * max(epochs, 1))
    return max(0.0, min(startup, wait_s, 0.5 * run_s))


def planned_pipeline_steps(
    config: RunConfig,
    pipeline: Pipeline,
    model: torch.nn.Module,
    *,
    seconds: float,
    expected_samples_per_s: float,
    dataset: Dataset | None = None,
    thread_count: int | None = None,
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
            config,
            pipeline,
            model,
            steps=max(16, least, guess // 20),
            dataset=dataset,
            thread_count=thread_count,
        )
        guess = pipeline_steps(
            seconds=seconds, expected_samples_per_s=trial.steady_samples_per_s, batch_size=batch
        )
    return max(guess, least)
