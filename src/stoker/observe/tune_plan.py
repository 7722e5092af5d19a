"""Planning the tuner's runs against its budget: how many steps a run gets, how many runs
fit, and the worker count the measured figures say keeps up with the step."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from stoker.observe.short_run import PipelineFigures

__all__ = [
    "MIN_BATCHES_PER_WORKER",
    "cache_first",
    "code_change_notes",
    "fitting",
    "import_optimizer_stack",
    "likely_workers",
    "paired_gains",
    "run_steps",
    "step_s_of",
]

#: Fewest batches of an epoch per worker the likely worker count is held to.
MIN_BATCHES_PER_WORKER = 4


def run_steps(
    seconds: float,
    *,
    overhead_s: float,
    step_s: float,
    fewest: int,
    epoch_steps: int | None,
    epochs: int,
) -> int | None:
    """Steps for one short run that fits in ``seconds``, its fixed cost included.

    Whole epochs when at least one fits (their times are then a real run's: start-up
    and shutdown inside), never more than the run's ``epochs`` (that is the real run);
    else as many steps as fit. None when not even ``fewest`` fit.
    """
    if step_s <= 0 or not math.isfinite(step_s):
        return None
    steps = int((seconds - overhead_s) / step_s)
    if steps < fewest:
        return None
    if epoch_steps and steps >= epoch_steps:
        return min(steps // epoch_steps, max(epochs, 1)) * epoch_steps
    return steps


def fitting(costs: Sequence[float], seconds: float) -> int:
    """How many of the runs costing ``costs`` (in order) fit in ``seconds``, keeping
    room for the winners together when three or more fit."""
    count, total = 0, 0.0
    for cost in costs:
        if total + cost > seconds:
            break
        total += cost
        count += 1
    if count >= 3 and total + max(costs[:count]) > seconds:
        count -= 1  # room for the winners together
    return count


def step_s_of(figures: PipelineFigures) -> float:
    """Seconds per step of a measured run (its loop time over its steps)."""
    return figures.epoch_s / max(figures.steps, 1)


#: A paired round where a candidate ran below this share of the configured settings' rate
#: is a collapse, not noise (in the scenario suite, load moved paired ratios by about a
#: third either way).
COLLAPSE = 0.5


def paired_gains(finals: dict[Any, list[Any]], baseline: Any) -> dict[Any, float]:
    """Each finalist's speed-up over the configured settings from the last rounds, where
    the two ran back to back in alternating order: its fastest run's rate over the
    configured settings' fastest, over the rounds both ran. Other load only ever slows a
    run, and the alternation gives both sides the same moments, so each side's fastest
    run is its least disturbed (as ``timeit`` takes the best of its repeats). The mean of
    the rounds was moved by a third by one loaded run (Parquet: the configured settings
    at 23,350 then 12,345 samples/s beside a cache at 19,429 and 19,589: 1.21x predicted,
    0.85x real; fastest runs: 0.84x); with two rounds, a median is that mean. From
    three paired rounds on, the median of the rounds' ratios: it drops the one round
    that load moved either way, where the two fastest runs, picked from different
    rounds, add the noisier side's luck (eight threads against two: rounds of 2.46x,
    2.01x and 2.83x; fastest runs 2.76x, median 2.46x, whole runs 2.21-2.42x).
    The configured settings' entry is 1.0. ``finals``: each candidate's race runs
    (``round``, ``rate``).

    A candidate that ran at under ``COLLAPSE`` of the configured rate in any round of
    the pair gets that worst ratio instead: its fastest run hides a setting that falls
    apart under load (two intra-op threads on a busy 2-core machine: 1.33x, 1.24x, then
    0.06x; its best runs predicted 1.31x and whole runs then trained at 0.06x)."""
    base = {run.round: run.rate for run in finals[baseline]}
    gains = {baseline: 1.0}
    for candidate, runs in finals.items():
        paired = [r for r in runs if base.get(r.round, 0) > 0]
        if candidate != baseline and paired:
            ratios = [r.rate / base[r.round] for r in paired]
            if min(ratios) < COLLAPSE:
                gains[candidate] = min(ratios)
            elif len(ratios) >= 3:
                gains[candidate] = statistics.median(ratios)
            else:
                top = max(base[r.round] for r in paired)
                gains[candidate] = max(r.rate for r in paired) / top
    return gains


def likely_workers(
    fetch: Any,
    calibration: PipelineFigures,
    *,
    batch_size: int,
    cores: int,
    cap: int,
    batches: int | None = None,
    epochs: int = 1,
) -> int | None:
    """The worker count that would just keep up with the step, from measured figures.

    A batch takes ``batch_size`` fetches (and a collate) of one worker; the training
    step's compute (forward, backward, optimizer: the calibration run's phase table) is
    how long the workers have to deliver it. A fetch that mostly waits (a low CPU share:
    disk, network) lets more workers than cores overlap their waits, up to the cores over
    that share. ``batches``: an epoch's batches; ``epochs``: the run's (the likely count
    is raced with persistent workers, started once a run). None when the fetch was not
    measured.
    """
    if fetch is None or fetch.per_sample_s <= 0:
        return None
    # Each worker's start (a fork, its first batch) is paid back over the batches it
    # fetches: at least MIN_BATCHES_PER_WORKER of the run's each. Persistent workers
    # start once for all epochs: an epoch's batches alone capped I/O latency at 8
    # workers (32 batches) where 16 were 1.2x faster over the 2 epochs.
    run_batches = batches * max(1, epochs) if batches else None
    most = max(1, run_batches // MIN_BATCHES_PER_WORKER) if run_batches else cap
    batch_s = batch_size * (fetch.per_sample_s + (fetch.collate_per_sample_s or 0.0))
    compute = sum(calibration.phases.get(k, 0.0) for k in ("forward", "backward", "optimizer"))
    compute_s = max(step_s_of(calibration) * compute, 1e-4)
    share = fetch.cpu_share if fetch.cpu_share > 0 else 1.0
    ceiling = cores if share >= 0.5 else math.ceil(cores / max(share, 1 / 64))
    return max(1, min(math.ceil(batch_s / compute_s), ceiling, cap, most))


def cache_first(
    fetch: Any, calibration: PipelineFigures, *, length: int | None, epochs: int, loader_rate: float
) -> bool:
    """Whether a memory cache should be raced before the best loader settings.

    The estimates, over the run's ``epochs``: cached, the data wait (the calibration's
    phase table) is gone after a fill of ``length`` samples read in order; with the best
    loader settings with workers, the pipeline runs at their loader alone's
    ``loader_rate``, no faster than compute. Only the order of the race: a tight budget
    runs the first only.
    """
    if fetch is None or not length or calibration.samples_per_s <= 0:
        return False
    rate = calibration.samples_per_s
    wait = min(calibration.phases.get("data_wait", 0.0), 0.99)
    run_s = epochs * length / rate
    fill_s = length * (fetch.fill_per_sample_s or fetch.per_sample_s)
    cached = run_s / (fill_s + run_s * (1 - wait))
    workers = min(loader_rate, rate / (1 - wait)) / rate
    return cached > workers


def import_optimizer_stack() -> None:
    """Build a throwaway optimizer before the budget's clock starts.

    A process's first ``torch.optim`` optimizer imports the compiler stack (about 2 s
    of CPU on 2 cores, 6 s on a busy machine): a one-off cost of the process, like
    ``import torch``, which otherwise landed in the first timed run and took the budget
    (a 3 s budget ended at 7-8 s under load).
    """
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)


#: The calibration's data wait from which a loader cost the tuner cannot change is named
#: (the doctor's partly-input-bound threshold is 5%; here the loader must matter more).
CODE_CHANGE_WAIT = 0.2


def code_change_notes(fetch: Any, calibration: PipelineFigures, *, batched: bool) -> list[str]:
    """What the doctor would call a code change, said by the tuner when the figures show it.

    The tuner writes config; a costly ``collate_fn`` (vectorise it) and a cheap
    ``dataset[i]`` paid one sample at a time (``__getitems__``) are fixed in code, and a
    run they bind may gain far more from that change than from any setting. Without
    this the tuner said "no change" (or a small gain) where the doctor's code change won
    6x (an expensive collate, per-sample in-memory tensors). Same thresholds as the
    doctor's collate-bound and loader-overhead verdicts, from the tuner's own figures:
    the fetch and collate timed side by side, the configured run's data wait.
    """
    from stoker.observe.advice import CHEAP_COLLATE_S, COLLATE_BOUND_SHARE
    from stoker.observe.proposals import CHEAP_SAMPLE_S

    wait = calibration.phases.get("data_wait", calibration.data_wait_fraction)
    if fetch is None or wait < CODE_CHANGE_WAIT:
        return []
    fetch_s = fetch.batched_per_sample_s if batched and fetch.batched_per_sample_s else None
    fetch_s = fetch.per_sample_s if fetch_s is None else fetch_s
    collate_s = fetch.collate_per_sample_s or 0.0
    lead = (
        f"the biggest gain needs a code change the tuner cannot write (the run waits for "
        f"data {wait:.0%} of its step; `stoker doctor` names it): "
    )
    if collate_s >= CHEAP_COLLATE_S and collate_s / (fetch_s + collate_s) >= COLLATE_BOUND_SHARE:
        share = collate_s / (fetch_s + collate_s)
        return [
            lead + f"vectorise the collate_fn ({collate_s * 1e6:.0f} µs per sample, "
            f"{share:.0%} of the loader's work; stack whole tensors, no per-sample Python "
            "loop); the settings above only spread it over more workers"
        ]
    if not batched and fetch.per_sample_s < CHEAP_SAMPLE_S:
        return [
            lead + f"fetch whole batches: dataset[i] is cheap ({fetch.per_sample_s * 1e6:.1f} "
            "µs) but paid one sample at a time; give the dataset a __getitems__(indices) "
            "that returns one batch, or keep the data in a stoker ArrayDataset"
        ]
    return []
