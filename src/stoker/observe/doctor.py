"""Bottleneck diagnosis: measure each stage alone, compare with the pipeline, name the fix."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from stoker.config import RunConfig
from stoker.data.loader_fast import serves_in_process
from stoker.observe.stages import (
    FetchFigures,
    LoaderPoint,
    PipelineFigures,
    TransferFigures,
    first_batch,
    measure_compute,
    measure_fetch,
    measure_pipeline,
    measure_transfer,
    planned_pipeline_steps,
    sweep_workers,
    usable_cores,
    worker_counts,
)
from stoker.train.pipeline import UserComponents, build_pipeline

__all__ = [
    "CHEAP_SAMPLE_S",
    "INPUT_BOUND_WAIT",
    "PARTLY_INPUT_BOUND_WAIT",
    "Diagnosis",
    "Measurements",
    "StageFigure",
    "Verdict",
    "diagnose",
    "measure_stages",
    "run_doctor",
]

logger = logging.getLogger("stoker")

Verdict = Literal[
    "input-bound",
    "partly input-bound",
    "loader-overhead",
    "oversubscribed",
    "transfer-bound",
    "compute-bound",
]
Stage = Literal["loader", "transfer", "compute"]

#: Data wait at or above this share of step time: the loader sets the pace.
INPUT_BOUND_WAIT = 0.20
#: Data wait at or above this share (and below INPUT_BOUND_WAIT): partly input-bound.
PARTLY_INPUT_BOUND_WAIT = 0.05
#: A ``dataset[i]`` cheaper than this is Python and dispatch overhead, not real work.
CHEAP_SAMPLE_S = 50e-6
#: Rates within this share of the best count as "as good" (measurement noise).
SAME_RATE = 0.95
#: A transfer ceiling below this share of the loader and compute ceilings binds.
TRANSFER_MARGIN = 0.8
#: Repeats that differ by more than this factor make a figure unstable (a busy machine).
UNSTABLE_SPREAD = 2.0


@dataclass(frozen=True)
class Measurements:
    """Every figure the verdict is drawn from; rates are samples per second.

    Attributes:
        device: The training device (``cpu``, ``cuda``, ...).
        cores: CPU cores this process may use.
        torch_threads: ``torch.get_num_threads()`` of the training process.
        batch_size: ``loader.batch_size``.
        num_workers: ``loader.num_workers`` as the loader runs it (0 for in-memory
            arrays, which it serves in-process whatever the config says).
        pin_memory: Whether the configured loader pins batches.
        returns_batches: Whether the loader fetches whole batches (``__getitems__``).
        seconds: Time per measurement.
        loader: The loader alone at each measured worker count.
        compute_samples_per_s: Forward + backward + optimizer step on a batch on the device.
        pipeline: The short real training run.
        transfer: Host-to-device copies; None without an accelerator.
        fetch: Per-sample fetch costs; None for a stream.
        compute_repeats: The compute rate of each repeat.
        machine_load: The 1-minute load average before measuring (other processes).
    """

    device: str
    cores: int
    torch_threads: int
    batch_size: int
    num_workers: int
    pin_memory: bool
    returns_batches: bool
    seconds: float
    loader: tuple[LoaderPoint, ...]
    compute_samples_per_s: float
    pipeline: PipelineFigures
    transfer: TransferFigures | None = None
    fetch: FetchFigures | None = None
    compute_repeats: tuple[float, ...] = ()
    machine_load: float | None = None

    def loader_rate(self, num_workers: int) -> float:
        """The loader-alone rate at ``num_workers`` (0.0 when not measured)."""
        for point in self.loader:
            if point.num_workers == num_workers:
                return point.samples_per_s
        return 0.0

    @property
    def configured_loader_rate(self) -> float:
        return self.loader_rate(self.num_workers)


@dataclass(frozen=True)
class StageFigure:
    """One row of the doctor's table."""

    stage: str
    samples_per_s: float | None
    vs_pipeline: float | None
    note: str = ""


@dataclass(frozen=True)
class Diagnosis:
    """The doctor's answer: what limits the pipeline, and what to change.

    Attributes:
        verdict: The bottleneck's name (see :data:`Verdict`).
        bottleneck: The stage that sets the pace: ``loader``, ``transfer`` or ``compute``.
        reason: The measured figures behind the verdict, in one sentence.
        recommendation: What to change, in words.
        recommended_loader: ``loader.*`` settings to apply (may be empty).
        expected_gain: Pipeline speed-up expected from the fix (ceiling / pipeline rate).
        gain_measured: Whether ``expected_gain`` comes from measured ceilings (False: an
            upper bound, such as the compute ceiling when loading became free).
        stages: The table rows.
        measurements: Every figure measured.
        warnings: Caveats about the measurements (e.g. unstable on a busy machine).
    """

    verdict: Verdict
    bottleneck: Stage
    reason: str
    recommendation: str
    recommended_loader: dict[str, Any]
    expected_gain: float | None
    gain_measured: bool
    stages: tuple[StageFigure, ...]
    measurements: Measurements
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (infinite or missing rates become null), ``verdict`` first."""
        return _json_ready(dataclasses.asdict(self))


def _json_ready(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# --- the verdict -----------------------------------------------------------------------


def _fewest_workers(points: list[LoaderPoint]) -> LoaderPoint | None:
    """The fewest workers whose rate is within noise of the best of ``points``."""
    if not points:
        return None
    best = max(p.samples_per_s for p in points)
    good = [p for p in points if p.samples_per_s >= SAME_RATE * best]
    return min(good, key=lambda p: p.num_workers)


def _oversubscribed(m: Measurements) -> LoaderPoint | None:
    """The worker count to use instead, when more workers are configured than cores serve.

    Two pieces of evidence, either enough: the measured rate grows far less than the
    worker count beyond the cores (the workers share the same CPUs), or the per-sample
    work is CPU time and the workers together want more CPU than there is.
    """
    configured = m.num_workers
    if configured <= m.cores:
        return None
    within = [p for p in m.loader if p.num_workers <= m.cores]
    # At least one worker: loading in the training process cannot overlap its compute.
    fewer = [
        p for p in m.loader if 1 <= p.num_workers < configured and p.num_workers <= m.cores + 1
    ]
    if not within or not fewer:
        return None
    base = max(within, key=lambda p: p.samples_per_s)
    scaling = m.configured_loader_rate / base.samples_per_s if base.samples_per_s > 0 else 0.0
    linear = configured / max(base.num_workers, 1)
    poor_scaling = scaling < 0.5 * linear
    cpu_demand = configured * m.fetch.cpu_share if m.fetch is not None else 0.0
    if not (poor_scaling or cpu_demand > m.cores):
        return None
    return _fewest_workers(fewer)


def _loader_figures(m: Measurements, pipeline: float) -> list[StageFigure]:
    best = _fewest_workers(list(m.loader))
    rows = []
    for point in m.loader:
        notes = []
        if point.num_workers == m.num_workers:
            notes.append("configured")
        if best is not None and point.num_workers == best.num_workers:
            notes.append("best")
        notes.append(f"start-up {point.startup_s:.2f} s")
        rows.append(
            StageFigure(
                stage=f"loader ({point.num_workers} worker{'s' * (point.num_workers != 1)})",
                samples_per_s=point.samples_per_s,
                vs_pipeline=_ratio(point.samples_per_s, pipeline),
                note=", ".join(notes),
            )
        )
    return rows


def _ratio(rate: float | None, pipeline: float) -> float | None:
    if rate is None or pipeline <= 0:
        return None
    return rate / pipeline


def _stage_figures(m: Measurements) -> tuple[StageFigure, ...]:
    pipeline = m.pipeline.steady_samples_per_s
    rows = _loader_figures(m, pipeline)
    if m.transfer is None:
        rows.append(StageFigure("transfer", None, None, "no accelerator: transfer is a no-op"))
    else:
        t = m.transfer
        rows.append(
            StageFigure(
                "transfer (pageable)",
                t.pageable_samples_per_s,
                _ratio(t.pageable_samples_per_s, pipeline),
                f"{t.pageable_gb_per_s:.1f} GB/s, {t.batch_bytes / 1e6:.2f} MB per batch",
            )
        )
        if t.pinned_gb_per_s is not None:
            rows.append(
                StageFigure(
                    "transfer (pinned)",
                    t.pinned_samples_per_s,
                    _ratio(t.pinned_samples_per_s, pipeline),
                    f"{t.pinned_gb_per_s:.1f} GB/s",
                )
            )
    rows.append(
        StageFigure(
            "compute",
            m.compute_samples_per_s,
            _ratio(m.compute_samples_per_s, pipeline),
            f"forward+backward+step on {m.device}, {m.torch_threads} thread(s)",
        )
    )
    if m.fetch is not None:
        f = m.fetch
        notes = [f"dataset[i] {f.per_sample_s * 1e6:.1f} µs ({f.cpu_share:.0%} CPU)"]
        if f.collate_per_sample_s is not None:
            notes.append(f"collate {f.collate_per_sample_s * 1e6:.2f} µs/sample")
        if f.batched_per_sample_s is not None:
            notes.append(f"__getitems__ {f.batched_per_sample_s * 1e6:.2f} µs/sample")
        rate = 1 / f.per_sample_s if f.per_sample_s > 0 else math.inf
        rows.append(
            StageFigure("fetch (one process)", rate, _ratio(rate, pipeline), ", ".join(notes))
        )
    p = m.pipeline
    rows.append(
        StageFigure(
            "pipeline",
            pipeline,
            1.0 if pipeline > 0 else None,
            f"{p.steps} steps, data wait {p.steady_data_wait_fraction:.0%} "
            f"({p.data_wait_fraction:.0%} with start-up)",
        )
    )
    return tuple(rows)


def _unstable(m: Measurements) -> list[str]:
    notes = []
    if m.machine_load is not None and m.machine_load >= 0.5 * m.cores:
        notes.append(
            f"the machine was busy before measuring (load {m.machine_load:.1f} on {m.cores} "
            "cores): other processes share the CPUs, so rates vary"
        )
    spreads = {f"loader ({p.num_workers} workers)": p.repeats for p in m.loader}
    spreads["compute"] = m.compute_repeats
    for name, repeats in spreads.items():
        finite = [r for r in repeats if math.isfinite(r) and r > 0]
        if len(finite) >= 2 and max(finite) / min(finite) > UNSTABLE_SPREAD:
            notes.append(
                f"{name}: repeats varied {max(finite) / min(finite):.1f}x "
                "(a busy machine?); rerun with more --seconds to confirm"
            )
    return notes


def diagnose(m: Measurements) -> Diagnosis:
    """Name the bottleneck from the measured figures and say what to change.

    The rules, in order:

    1. ``transfer-bound``: host-to-device copies at the configured pinning are slower
       than both the loader and compute (only with an accelerator).
    2. The pipeline waits for data (>= 5% of step time):
       ``oversubscribed`` when more workers are configured than the cores can serve,
       ``loader-overhead`` when samples are fetched one by one and each is cheap
       (per-sample Python and collate dominate), else ``input-bound`` (>= 20%) or
       ``partly input-bound``.
    3. Otherwise ``compute-bound``.
    """
    pipeline = m.pipeline.steady_samples_per_s
    wait = m.pipeline.steady_data_wait_fraction
    loader_now = m.configured_loader_rate
    compute = m.compute_samples_per_s
    stages = _stage_figures(m)
    notes = tuple(_unstable(m))
    make = functools.partial(Diagnosis, stages=stages, measurements=m, warnings=notes)

    def gain(ceiling: float) -> float | None:
        return ceiling / pipeline if pipeline > 0 and math.isfinite(ceiling) else None

    transfer = m.transfer
    if transfer is not None:
        now = transfer.pageable_samples_per_s
        if m.pin_memory and transfer.pinned_samples_per_s is not None:
            now = transfer.pinned_samples_per_s
        if now < TRANSFER_MARGIN * min(loader_now, compute):
            pinned = transfer.pinned_samples_per_s
            if not m.pin_memory and pinned is not None:
                return make(
                    verdict="transfer-bound",
                    bottleneck="transfer",
                    reason=(
                        f"host-to-device copies carry {now:,.0f} samples/s, below the loader "
                        f"({loader_now:,.0f}) and compute ({compute:,.0f}); pinned copies "
                        f"carry {pinned:,.0f}"
                    ),
                    recommendation=(
                        "set loader.pin_memory=true (stoker copies with non_blocking=True, "
                        "so pinned batches overlap with compute); a side-stream prefetcher "
                        "hides the rest of the copy"
                    ),
                    recommended_loader={"pin_memory": True},
                    expected_gain=gain(min(pinned, loader_now, compute)),
                    gain_measured=True,
                )
            return make(
                verdict="transfer-bound",
                bottleneck="transfer",
                reason=(
                    f"host-to-device copies carry {now:,.0f} samples/s "
                    f"({transfer.batch_bytes / 1e6:.1f} MB per batch), below the loader "
                    f"({loader_now:,.0f}) and compute ({compute:,.0f})"
                ),
                recommendation=(
                    "copy less: send compact dtypes (uint8 images, int32 ids) and convert on "
                    "the device; overlap copies with compute with a side-stream prefetcher"
                ),
                recommended_loader={},
                expected_gain=gain(min(loader_now, compute)),
                gain_measured=False,
            )

    if wait >= PARTLY_INPUT_BOUND_WAIT:
        share = f"the pipeline waits for data {wait:.0%} of the time"
        fewer = _oversubscribed(m)
        if fewer is not None:
            saved = m.num_workers - fewer.num_workers
            evidence = []
            if m.fetch is not None:
                evidence.append(
                    f"dataset[i] is {m.fetch.cpu_share:.0%} CPU work, so {m.num_workers} workers "
                    f"want {m.num_workers * m.fetch.cpu_share:.1f} of {m.cores} cores"
                )
            evidence.append(
                f"the loader alone delivers {loader_now:,.0f} samples/s with {m.num_workers} "
                f"workers and {fewer.samples_per_s:,.0f} with {fewer.num_workers} "
                f"({_ratio(loader_now, fewer.samples_per_s) or 0:.2f}x for "
                f"{m.num_workers / max(fewer.num_workers, 1):.1f}x the workers)"
            )
            if loader_now > fewer.samples_per_s / SAME_RATE:
                evidence.append(
                    f"beyond {m.cores} cores that extra speed is CPU time taken from other "
                    "processes on the machine, not idle cores"
                )
            return make(
                verdict="oversubscribed",
                bottleneck="loader",
                reason=f"{share}; " + "; ".join(evidence),
                recommendation=(
                    f"set loader.num_workers={fewer.num_workers} (the fewest workers within 5% "
                    f"of the best measured from 1 to cores + 1): {saved} fewer processes, their "
                    "memory and CPU left to training; more workers than cores cannot make "
                    "more CPU"
                ),
                recommended_loader={"num_workers": fewer.num_workers},
                expected_gain=gain(min(fewer.samples_per_s, compute)),
                gain_measured=True,
            )
        fetch = m.fetch
        if not m.returns_batches and fetch is not None and fetch.per_sample_s < CHEAP_SAMPLE_S:
            per_sample_loader = 1 / loader_now if loader_now > 0 else math.inf
            best = _fewest_workers(list(m.loader))
            workers_note = ""
            if best is not None and best.num_workers <= m.num_workers:
                workers_note = (
                    f"; workers do not help (best measured: {best.num_workers} workers, "
                    f"{best.samples_per_s:,.0f} samples/s)"
                )
            return make(
                verdict="loader-overhead",
                bottleneck="loader",
                reason=(
                    f"{share}; each sample is cheap (dataset[i] "
                    f"{fetch.per_sample_s * 1e6:.1f} µs) but the loader spends "
                    f"{per_sample_loader * 1e6:.1f} µs per sample fetching and collating one "
                    f"at a time, while compute needs {1e6 / compute:.1f} µs{workers_note}"
                ),
                recommendation=(
                    "fetch whole batches: set data.cache=memory (a deterministic dataset is "
                    "read once into arrays and served a batch at a time, no code change), give "
                    "the dataset a __getitems__(indices) that returns one batch "
                    "(returns_batches = True), or keep the data in a stoker ArrayDataset; "
                    "raise loader.batch_size to amortize per-batch costs; do NOT add workers: "
                    "they add inter-process copies to cheap samples"
                ),
                recommended_loader={},
                expected_gain=gain(compute),
                gain_measured=False,
            )
        verdict: Verdict = "input-bound" if wait >= INPUT_BOUND_WAIT else "partly input-bound"
        best = _fewest_workers(list(m.loader))
        if best is not None and best.num_workers == 0 and m.num_workers > 0:
            # Alone the main process may load fastest, but in training it also computes.
            best = _fewest_workers([p for p in m.loader if p.num_workers > 0]) or best
        fixes = []
        recommended: dict[str, Any] = {}
        expected = None
        if (
            best is not None
            and best.num_workers != m.num_workers
            and (best.samples_per_s > loader_now / SAME_RATE)
        ):
            recommended["num_workers"] = best.num_workers
            fixes.append(
                f"set loader.num_workers={best.num_workers} (measured {best.samples_per_s:,.0f} "
                f"samples/s vs {loader_now:,.0f} now)"
            )
            expected = gain(min(best.samples_per_s, compute))
        if fetch is not None:
            getitem_share = fetch.per_sample_s / max(m.num_workers, 1) * loader_now
            if getitem_share >= 0.5:
                fixes.append(
                    f"dataset[i] takes {fetch.per_sample_s * 1e3:.2f} ms, "
                    f"{min(getitem_share, 1):.0%} of the loader's time: cache or preprocess "
                    "samples once (decoded arrays on disk or in memory)"
                )
        if not m.returns_batches and fetch is not None:
            fixes.append(
                "fetch whole batches (data.cache=memory, __getitems__ or a stoker ArrayDataset)"
            )
        elif fetch is None:
            fixes.append("yield whole batches from the stream instead of single samples")
        fixes.append("run `stoker tune` to search prefetch and persistent workers too")
        return make(
            verdict=verdict,
            bottleneck="loader",
            reason=(
                f"{share}; the loader alone delivers {loader_now:,.0f} samples/s, compute "
                f"alone {compute:,.0f}, the pipeline {pipeline:,.0f}"
            ),
            recommendation="; ".join(fixes),
            recommended_loader=recommended,
            expected_gain=expected,
            gain_measured=expected is not None,
        )

    fixes = [
        "a bigger batch (loader.batch_size) if memory allows",
        "bf16 autocast (train.precision=bf16)",
        "torch.compile (train.compile=true)",
        "beyond that a bigger accelerator is the only lever; the input pipeline keeps up",
    ]
    if m.device == "cpu":
        fixes.insert(0, "train on a GPU")
    return make(
        verdict="compute-bound",
        bottleneck="compute",
        reason=(
            f"the pipeline waits for data only {wait:.0%} of the time; compute alone "
            f"delivers {compute:,.0f} samples/s, the loader alone {loader_now:,.0f}, the "
            f"pipeline {pipeline:,.0f}"
        ),
        recommendation="; ".join(fixes),
        recommended_loader={},
        expected_gain=None,
        gain_measured=False,
    )


# --- measuring -------------------------------------------------------------------------


def run_doctor(
    config: RunConfig,
    *,
    seconds: float = 2.5,
    user: UserComponents | None = None,
    max_workers: int = 16,
    repeats: int = 3,
    say: Callable[[str], None] | None = None,
) -> Diagnosis:
    """Measure every stage of ``config``'s pipeline alone, run it for real, diagnose.

    Args:
        config: The run config to examine (nothing is written next to it).
        seconds: Time per measurement (each loader worker count, compute, pipeline).
        user: Python objects in place of config names, as for ``stoker.fit``.
        max_workers: Highest worker count measured besides the configured one.
        repeats: Groups per measurement; medians are reported.
        say: Called with a line before each measurement (progress for people).
    """
    with warnings.catch_warnings():
        # Measuring more workers than cores is the point here; PyTorch warns about it.
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        measurements = measure_stages(
            config,
            seconds=seconds,
            user=user,
            max_workers=max_workers,
            repeats=repeats,
            say=say or (lambda line: logger.debug(line)),
        )
    return diagnose(measurements)


def measure_stages(
    config: RunConfig,
    *,
    seconds: float,
    user: UserComponents | None,
    max_workers: int,
    repeats: int,
    say: Callable[[str], None],
) -> Measurements:
    """The measurements of :func:`run_doctor`, without the verdict."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    pipeline = build_pipeline(config, user or UserComponents())
    fresh_model = copy.deepcopy(pipeline.model)
    loader_cfg = config.loader
    cores = usable_cores()
    workers = loader_cfg.num_workers
    counts = worker_counts(cores, workers, cap=max_workers)
    if serves_in_process(pipeline.train_data, batched=pipeline.train_loader.returns_batches):
        # build_loader serves in-memory arrays in-process whatever num_workers says: every
        # worker count would measure the same loader.
        workers, counts = 0, [0]
        say("in-memory arrays: the loader serves them in-process, without workers")
    say(f"loader alone at {', '.join(map(str, counts))} workers ({seconds:g} s each)")
    points = sweep_workers(config, pipeline, counts, seconds=seconds, repeats=repeats)
    batch = first_batch(config, pipeline)
    device = pipeline.device
    say(f"host-to-device transfer ({device})")
    transfer = measure_transfer(batch, device, seconds=seconds)
    say("compute alone (forward, backward, optimizer step)")
    compute = measure_compute(
        fresh_model,
        batch,
        pipeline.loss_fn,
        config=config,
        device=device,
        seconds=seconds,
        repeats=repeats,
    )
    say("per-sample fetch cost")
    fetch = measure_fetch(
        pipeline.train_data,
        batch_size=loader_cfg.batch_size,
        collate_fn=pipeline.collate_fn,
        seconds=min(seconds, 1.5),
        seed=config.seed,
    )
    configured = next(p for p in points if p.num_workers == workers)
    steps = planned_pipeline_steps(
        config,
        pipeline,
        fresh_model,
        seconds=seconds,
        expected_samples_per_s=min(configured.samples_per_s, compute.samples_per_s),
    )
    say(f"the pipeline: {steps} training steps through stoker's loop")
    return Measurements(
        device=device.type,
        cores=cores,
        torch_threads=torch.get_num_threads(),
        batch_size=loader_cfg.batch_size,
        num_workers=workers,
        pin_memory=bool(pipeline.train_loader.dataloader.pin_memory),
        returns_batches=pipeline.train_loader.returns_batches,
        seconds=seconds,
        loader=tuple(points),
        compute_samples_per_s=compute.samples_per_s,
        compute_repeats=compute.repeats,
        pipeline=measure_pipeline(config, pipeline, fresh_model, steps=steps),
        transfer=transfer,
        fetch=fetch,
        machine_load=load,
    )
