"""Planning the tuner's runs against its budget: how many steps a run gets, how many runs
fit, and the worker count the measured figures say keeps up with the step."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from stoker.observe.short_run import PipelineFigures

__all__ = [
    "MIN_BATCHES_PER_WORKER",
    "cache_first",
    "fitting",
    "import_optimizer_stack",
    "likely_workers",
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


def likely_workers(
    fetch: Any,
    calibration: PipelineFigures,
    *,
    batch_size: int,
    cores: int,
    cap: int,
    batches: int | None = None,
) -> int | None:
    """The worker count that would just keep up with the step, from measured figures.

    A batch takes ``batch_size`` fetches (and a collate) of one worker; the training
    step's compute (forward, backward, optimizer: the calibration run's phase table) is
    how long the workers have to deliver it. A fetch that mostly waits (a low CPU share:
    disk, network) lets more workers than cores overlap their waits, up to the cores over
    that share. ``batches``: an epoch's batches. None when the fetch was not measured.
    """
    if fetch is None or fetch.per_sample_s <= 0:
        return None
    # Each worker's start (a fork, its first batch) is paid back over the batches it
    # fetches: at least MIN_BATCHES_PER_WORKER of an epoch's each.
    most = max(1, batches // MIN_BATCHES_PER_WORKER) if batches else cap
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
