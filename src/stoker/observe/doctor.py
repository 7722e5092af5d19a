"""Bottleneck diagnosis: measure each stage alone, run the pipeline, name the bottleneck,
and confirm each proposed change with a short run of the pipeline with it applied."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import warnings
from collections.abc import Callable

import torch

from stoker.config import RunConfig
from stoker.data.loader_fast import serves_in_process
from stoker.observe.advice import (
    CHEAP_SAMPLE_S,
    INPUT_BOUND_WAIT,
    MIN_GAIN,
    PARTLY_INPUT_BOUND_WAIT,
    diagnose,
    settle,
)
from stoker.observe.measurements import Change, Diagnosis, Measurements, StageFigure, Verdict
from stoker.observe.short_run import (
    PipelineFigures,
    apply_settings,
    cached_data,
    measure_pipeline,
    planned_pipeline_steps,
)
from stoker.observe.short_run import threads as thread_count
from stoker.observe.stages import (
    first_batch,
    measure_compute,
    measure_fetch,
    measure_transfer,
    sweep_workers,
    usable_cores,
    worker_counts,
)
from stoker.train.optim import build_optimizer
from stoker.train.pipeline import Pipeline, UserComponents, build_pipeline

__all__ = [
    "CHEAP_SAMPLE_S",
    "INPUT_BOUND_WAIT",
    "PARTLY_INPUT_BOUND_WAIT",
    "Change",
    "Diagnosis",
    "Measurements",
    "StageFigure",
    "Verdict",
    "confirm_changes",
    "diagnose",
    "measure_stages",
    "run_doctor",
]

logger = logging.getLogger("stoker")

#: Proposals confirmed by a short run each, best predicted first.
MAX_CONFIRMED = 3
#: An optimizer share of compute from which the fused kernel is measured too.
FUSED_WORTH_MEASURING = 0.15


# --- measuring -------------------------------------------------------------------------


def run_doctor(
    config: RunConfig,
    *,
    seconds: float = 2.5,
    user: UserComponents | None = None,
    max_workers: int = 16,
    repeats: int = 3,
    confirm: bool = True,
    say: Callable[[str], None] | None = None,
) -> Diagnosis:
    """Measure every stage of ``config``'s pipeline alone, run it for real, diagnose, and
    confirm each proposed change with a short run of the pipeline with it applied.

    Args:
        config: The run config to examine (nothing is written next to it).
        seconds: Time per measurement (each loader worker count, compute, pipeline).
        user: Python objects in place of config names, as for ``stoker.fit``.
        max_workers: Highest worker count measured besides the configured one.
        repeats: Groups per measurement; medians are reported.
        confirm: Try the proposals in short runs (off: the predicted gains only).
        say: Called with a line before each measurement (progress for people).
    """
    say = say or (lambda line: logger.debug(line))
    with warnings.catch_warnings():
        # Measuring more workers than cores is the point here; PyTorch warns about it.
        warnings.filterwarnings("ignore", message=".*worker processes in total.*")
        pipeline = build_pipeline(config, user or UserComponents())
        model = copy.deepcopy(pipeline.model)
        measurements = measure_stages(
            config,
            seconds=seconds,
            pipeline=pipeline,
            model=model,
            max_workers=max_workers,
            repeats=repeats,
            say=say,
        )
        diagnosis = diagnose(measurements)
        if not confirm:
            return diagnosis
        gains = confirm_changes(config, pipeline, model, diagnosis, seconds=seconds, say=say)
    return settle(diagnosis, gains)


def _rate(figures: PipelineFigures, m: Measurements) -> float:
    """What a real run of the configured epochs would show (start-up and a cache's fill
    paid as often as a run pays them)."""
    return figures.run_rate(max(m.epochs, 1))


def confirm_changes(
    config: RunConfig,
    pipeline: Pipeline,
    model: torch.nn.Module,
    diagnosis: Diagnosis,
    *,
    seconds: float,
    say: Callable[[str], None],
) -> dict[str, float]:
    """Run the pipeline with each of the best proposals applied: ``{label: speed-up}``.

    The speed-up is over the configured pipeline, measured again after the changes
    (the mean of both runs: a machine that got busier in between does not pass for a
    loss or a gain). When two changes on different keys each win, they are tried
    together too.
    """
    m = diagnosis.measurements
    tried = [c for c in diagnosis.changes if c.predicted_gain > MIN_GAIN][:MAX_CONFIRMED]
    if not tried:
        return {}
    rates: dict[str, float] = {}
    for change in tried:
        say(f"confirming {change.label()}: a short run with it applied")
        rates[change.label()] = _run_with(config, pipeline, model, change.settings, m, seconds)
    say("the pipeline as configured again, beside the changes")
    again = _run_with(config, pipeline, model, {}, m, seconds)
    base = 0.5 * (_rate(m.pipeline, m) + again)
    gains = {label: rate / base for label, rate in rates.items() if base > 0}
    winners = [c for c in tried if gains.get(c.label(), 0) > MIN_GAIN]
    keys = [k for c in winners for k in c.settings]
    if len(winners) >= 2 and len(keys) == len(set(keys)):
        together = Change({k: v for c in winners for k, v in c.settings.items()}, "", 1.0)
        say(f"confirming {together.label()}: the winning changes together")
        rate = _run_with(config, pipeline, model, together.settings, m, seconds)
        gains[together.label()] = rate / base
    return gains


def _run_with(
    config: RunConfig,
    pipeline: Pipeline,
    model: torch.nn.Module,
    settings: dict,
    m: Measurements,
    seconds: float,
) -> float:
    """The run-level rate of a short run of the pipeline with ``settings`` applied."""
    changed = apply_settings(config, settings)
    threads = settings.get("train.threads")
    data, fill_s = cached_data(changed, pipeline.train_data)
    expected = m.pipeline.steady_samples_per_s
    steps = planned_pipeline_steps(
        changed,
        pipeline,
        model,
        seconds=seconds,
        expected_samples_per_s=expected,
        dataset=data,
        thread_count=threads,
    )
    figures = measure_pipeline(
        changed, pipeline, model, steps=steps, dataset=data, thread_count=threads
    )
    figures = dataclasses.replace(figures, prepare_s=fill_s)
    return _rate(figures, m)


def _fused(config: RunConfig, model: torch.nn.Module, device: torch.device) -> bool:
    """Whether the configured optimizer runs PyTorch's fused kernel."""
    optimizer = build_optimizer(copy.deepcopy(model), config.optim, device=device)
    return bool(optimizer.defaults.get("fused"))


def measure_stages(
    config: RunConfig,
    *,
    seconds: float,
    pipeline: Pipeline,
    model: torch.nn.Module,
    max_workers: int,
    repeats: int,
    say: Callable[[str], None],
) -> Measurements:
    """The measurements of :func:`run_doctor`, without the verdict."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    loader_cfg = config.loader
    cores = usable_cores()
    say("per-sample fetch cost")
    fetch = measure_fetch(
        pipeline.train_data,
        batch_size=loader_cfg.batch_size,
        collate_fn=pipeline.collate_fn,
        seconds=min(seconds, 1.5),
        seed=config.seed,
    )
    workers = loader_cfg.num_workers
    counts = worker_counts(
        cores, workers, cap=max_workers, cpu_share=fetch.cpu_share if fetch else None
    )
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

    def compute_alone(run_config: RunConfig, span: float):
        return measure_compute(
            model,
            batch,
            pipeline.loss_fn,
            config=run_config,
            device=device,
            seconds=span,
            repeats=repeats,
        )

    say("compute alone (forward, backward, optimizer step)")
    compute = compute_alone(config, seconds)
    fused = _fused(config, model, device)
    fused_rate = None
    if (
        not fused
        and config.optim.name != "sgd"
        and compute.optimizer_share >= FUSED_WORTH_MEASURING
    ):
        say("compute alone with the fused optimizer (optim.fused=true)")
        fused_config = apply_settings(config, {"optim.fused": True})
        fused_rate = compute_alone(fused_config, seconds / 2).samples_per_s
    torch_threads = torch.get_num_threads()
    thread_rates = {}
    if device.type == "cpu":
        # Fewer threads when they oversubscribe the cores; more when cores sit unused (a
        # run limited to one thread, e.g. by OMP_NUM_THREADS, on cores the loader leaves).
        others = {1, max(1, cores // (workers + 1))} - {torch_threads}
        for count in sorted(others):
            say(f"compute alone at {count} intra-op thread(s)")
            with thread_count(count):
                thread_rates[count] = compute_alone(config, seconds / 2).samples_per_s
    configured = next(p for p in points if p.num_workers == workers)
    run_config = apply_settings(config, {"loader.num_workers": workers})
    steps = planned_pipeline_steps(
        run_config,
        pipeline,
        model,
        seconds=seconds,
        expected_samples_per_s=min(configured.samples_per_s, compute.samples_per_s),
    )
    say(f"the pipeline: {steps} training steps through stoker's loop")
    figures = measure_pipeline(
        run_config, pipeline, model, steps=steps, loader_startup_s=configured.startup_s
    )
    try:
        length: int | None = len(pipeline.train_data)  # type: ignore[arg-type]
    except TypeError:
        length = None
    return Measurements(
        device=device.type,
        cores=cores,
        torch_threads=torch_threads,
        batch_size=loader_cfg.batch_size,
        num_workers=workers,
        pin_memory=bool(pipeline.train_loader.dataloader.pin_memory),
        returns_batches=pipeline.train_loader.returns_batches,
        seconds=seconds,
        loader=tuple(points),
        compute_samples_per_s=compute.samples_per_s,
        compute_repeats=compute.repeats,
        pipeline=figures,
        transfer=transfer,
        fetch=fetch,
        machine_load=load,
        compute_shares=(compute.forward_share, compute.backward_share, compute.optimizer_share),
        optimizer=config.optim.name,
        fused=fused,
        fused_samples_per_s=fused_rate,
        thread_rates=thread_rates,
        dataset_length=length,
        epochs=config.train.epochs,
        cache=config.data.cache,
        persistent_workers=loader_cfg.persistent_workers,
    )
