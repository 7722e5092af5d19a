"""The tuner's second stage: the doctor's other changes (a memory cache, the fused
optimizer, the intra-op thread count) beside the best loader settings, raced in short
training runs of the whole pipeline planned against what is left of the budget."""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from stoker.config import LoaderConfig, RunConfig
from stoker.data.sources import ArrayDataset, length_or_none
from stoker.observe.halving import Candidate
from stoker.observe.proposals import CHEAP_SAMPLE_S, MIN_GAIN
from stoker.observe.short_run import PipelineFigures, apply_settings
from stoker.observe.stages import usable_cores
from stoker.observe.tune_plan import fitting, paired_gains, run_steps, step_s_of
from stoker.train.optim import build_optimizer
from stoker.train.pipeline import Pipeline

__all__ = [
    "Facts",
    "PipelineRace",
    "candidate_scale",
    "changed_settings",
    "config_with",
    "facts_of",
    "other_changes",
    "race",
    "run_steps",
    "shortlist",
]

#: The share of the race's time its first round (every candidate, briefly) gets.
SCREEN_SHARE = 0.55
#: A cache whose fill would take more than this share of the time left is not tried.
CACHE_FILL_SHARE = 0.25
#: A cache whose decoded samples would take more than this share of free memory is not tried.
CACHE_MEMORY_SHARE = 0.5
#: The most rounds of the configured settings against the finalists, side by side.
MAX_FINAL_ROUNDS = 5
#: The most a run's fixed cost is taken to be before the race has run one.
FIRST_OVERHEAD_S = 0.5
#: Candidates besides the configured settings measured again, longer, in the last round.
FINALISTS = 1
#: A race run is stopped at this multiple of its planned seconds.
RUN_SLACK = 1.5


@dataclass(frozen=True)
class Facts:
    """What decides which of the doctor's other changes apply to a run.

    Attributes:
        device: The training device type (``cpu``, ``cuda``).
        cores: Usable CPU cores.
        workers: The configured ``loader.num_workers`` (as the loader runs it).
        threads: The intra-op threads the configured run used (0: unknown).
        optimizer: ``optim.name``; ``fused``: whether it runs the fused kernel.
        cache: ``data.cache``.
        length: Samples in the training data (None: a stream).
        in_memory: Whether the data is in-memory arrays already (nothing to cache).
        per_sample_s: ``dataset[i]`` (None: not measured).
        sample_bytes: One decoded sample's tensors (None: unknown).
        free_bytes: Memory available.
        epochs: ``train.epochs``.
        left_s: The tuner's time left.
        fill_sample_s: ``dataset[i]`` per sample read in order, as a cache's fill reads
            (None: ``per_sample_s``).
    """

    device: str
    cores: int
    workers: int
    threads: int
    optimizer: str
    fused: bool
    cache: str
    length: int | None
    in_memory: bool
    per_sample_s: float | None
    sample_bytes: int | None
    free_bytes: int | None
    epochs: int
    left_s: float
    fill_sample_s: float | None = None


def other_changes(facts: Facts) -> tuple[list[dict[str, Any]], list[str]]:
    """The doctor's changes besides the loader's that could apply, as Candidate fields
    (``{"cache": "memory"}``, ``{"fused": True}``, ``{"threads": 1}``), and a note for
    each one left out for a reason a user should know (too slow to fill, too big).

    The same kinds the doctor proposes (see ``stoker.observe.proposals``), without its
    predictions: the tuner's short runs measure each.
    """
    found: list[dict[str, Any]] = []
    notes: list[str] = []
    if facts.cache == "none" and facts.length and not facts.in_memory:
        cheap = facts.per_sample_s is not None and facts.per_sample_s < CHEAP_SAMPLE_S
        fill_s = facts.length * (facts.fill_sample_s or facts.per_sample_s or 0.0)
        size = facts.length * facts.sample_bytes if facts.sample_bytes else None
        if facts.epochs < 2 and not cheap:
            pass  # one epoch: filling the cache costs what the epoch would
        elif fill_s > CACHE_FILL_SHARE * facts.left_s:
            notes.append(
                f"data.cache=memory not tried: filling it would take about {fill_s:.0f} s "
                f"({facts.length:,} samples), more than the budget allows; try "
                "`stoker doctor`, or a larger --budget-s"
            )
        elif size is not None and facts.free_bytes and size > CACHE_MEMORY_SHARE * facts.free_bytes:
            notes.append(
                f"data.cache=memory not tried: the decoded samples take about "
                f"{size / 2**30:.1f} GiB, more than half the free memory "
                f"({facts.free_bytes / 2**30:.1f} GiB); data.cache=disk keeps them on disk"
            )
        else:
            found.append({"cache": "memory"})
    if facts.optimizer in ("adam", "adamw") and not facts.fused:
        found.append({"fused": True})
    if facts.device == "cpu":
        counts = {1, max(1, facts.cores // (facts.workers + 1))} - {facts.threads}
        found.extend({"threads": count} for count in sorted(counts))
    return found, notes


def shortlist(
    ranked: Sequence[Candidate],
    baseline: Candidate,
    changes: Sequence[dict[str, Any]],
    *,
    phases: dict[str, float],
    loaders: int = 2,
    cache_first: bool = False,
) -> list[Candidate]:
    """The race's candidates, likeliest first (a tight budget drops the last).

    The best ``loaders`` loader candidates (by the loader alone) and the best one
    without workers when the configured run has some; each other change applied to the
    configured loader settings, and to the best loader candidate. Ordered by the share
    of the configured run's step that each one's stage took (``phases``, the run's own
    phase table): data wait for the loader and the cache (the cache first when
    ``cache_first``), the optimizer for the fused kernel, half of compute for the thread
    count.
    """
    others = [c for c in ranked if c != baseline]
    picked = others[:loaders]
    if baseline.num_workers:
        picked += [c for c in others if c.num_workers == 0][:1]
    loaders_first = list(dict.fromkeys(picked))
    wait = phases.get("data_wait", 0.0)
    compute = sum(phases.get(k, 0.0) for k in ("forward", "backward", "optimizer"))
    # The best loader candidate, then a cache, then the other loader candidates.
    scored = [(wait * (1.0 if i == 0 else 0.9), c) for i, c in enumerate(loaders_first)]
    best = loaders_first[0] if loaders_first else None
    for change in changes:
        # Another thread count wins only where threads oversubscribe: half the weight.
        # A cache ahead of the best loader candidate when its estimate wins (cache_first).
        cache = wait * (1.05 if cache_first else 1.0)
        weight = {"cache": cache, "fused": phases.get("optimizer", 0.0), "threads": compute / 2}
        score = max(weight[key] for key in change)
        base = baseline
        if "cache" in change and baseline.num_workers:
            # Cached samples are served a batch at a time in the training process.
            base = dataclasses.replace(baseline, num_workers=0, prefetch_factor=None)
            base = dataclasses.replace(base, persistent_workers=False)
        scored.append((score, dataclasses.replace(base, **change)))
        if best is not None and "cache" not in change:
            scored.append((0.5 * score, dataclasses.replace(best, **change)))
    ordered = [c for _, c in sorted(scored, key=lambda pair: -pair[0])]
    return [c for c in dict.fromkeys(ordered) if c != baseline]


@dataclass(frozen=True)
class RaceRun:
    """One short training run of the race."""

    candidate: Candidate
    round: int
    figures: PipelineFigures
    rate: float


@dataclass(frozen=True)
class PipelineRace:
    """What the race measured: every run, the winner, and its gain: the mean of its
    last-round rates over the configured settings' (measured in the same rounds)."""

    runs: tuple[RaceRun, ...]
    winner: Candidate
    gain: float
    baseline_figures: PipelineFigures
    winner_figures: PipelineFigures
    dropped: tuple[Candidate, ...] = ()

    def rates(self) -> dict[Candidate, float]:
        """Each candidate's rate over the configured epochs: the mean of its runs in
        its last round kind (the first round's, or the last rounds' side by side)."""
        found: dict[Candidate, list[RaceRun]] = {}
        for run in self.runs:
            kept = found.setdefault(run.candidate, [])
            if kept and (kept[-1].round >= 2) != (run.round >= 2):
                kept.clear()
            kept.append(run)
        return {c: sum(r.rate for r in rs) / len(rs) for c, rs in found.items()}


#: ``measure(candidate, steps, deadline) -> figures`` (None: it could not be run).
Measure = Callable[[Candidate, int, float], PipelineFigures | None]


def race(
    candidates: Sequence[Candidate],
    baseline: Candidate,
    calibration: PipelineFigures,
    measure: Measure,
    *,
    deadline: float,
    epochs: int,
    epoch_steps: Callable[[Candidate], int | None],
    fewest: Callable[[Candidate], int],
    scale: Callable[[Candidate], float],
    clock: Callable[[], float] = time.perf_counter,
) -> PipelineRace:
    """Short training runs of the whole pipeline: every candidate once, briefly (the
    configured settings' is ``calibration``), then the configured settings and the
    best few again, longer, side by side; the winner is the fastest of that last round.

    Each run is planned against the time left before ``deadline``: its fixed cost
    (building the run, the workers' start and stop; the largest seen so far) and its
    steps at its step time (its own once measured, else the configured one's scaled by
    ``scale``); a run that does not fit is skipped, and each run is stopped at the
    deadline whatever its plan. When two or more changes each win, they are tried
    together.
    """
    step_s: dict[Candidate, float] = {baseline: step_s_of(calibration)}
    # A run's fixed cost: the calibration's, but no more than FIRST_OVERHEAD_S (the first
    # run of a process also pays one-time imports), then the mean of the race's runs.
    overheads: list[float] = []
    overhead = min(max(0.0, calibration.wall_s - calibration.epoch_s), FIRST_OVERHEAD_S)
    runs: list[RaceRun] = [RaceRun(baseline, 0, calibration, calibration.run_rate(epochs))]
    dropped: list[Candidate] = []

    def plan(candidate: Candidate, seconds: float) -> int | None:
        each = step_s.get(candidate, step_s[baseline] * scale(candidate))
        return run_steps(
            seconds,
            overhead_s=overhead,
            step_s=each,
            fewest=fewest(candidate),
            epoch_steps=epoch_steps(candidate),
            epochs=epochs,
        )

    def least(candidate: Candidate) -> float:
        """Seconds of the candidate's fewest steps, its fixed cost included."""
        each = step_s.get(candidate, step_s[baseline] * scale(candidate))
        return overhead + fewest(candidate) * each

    def one(candidate: Candidate, round_index: int, seconds: float) -> RaceRun | None:
        nonlocal overhead
        steps = plan(candidate, seconds)
        if steps is None:
            return None
        # Stopped at half again its share: a candidate that much slower than planned
        # (threads spinning on a busy machine: 10x) is losing, and must not take the
        # others' time (one took 5.8 s of a 1 s share).
        figures = measure(candidate, steps, min(deadline, clock() + RUN_SLACK * seconds))
        if figures is None:
            return None
        if not figures.cut_short:
            step_s[candidate] = step_s_of(figures)
            overheads.append(max(0.0, figures.wall_s - figures.epoch_s))
            overhead = sum(overheads) / len(overheads)
        run = RaceRun(candidate, round_index, figures, figures.run_rate(epochs))
        runs.append(run)
        return run

    # Round 1: as many candidates as fit, likeliest first, each briefly.
    screen_end = clock() + SCREEN_SHARE * max(0.0, deadline - clock())
    todo = list(dict.fromkeys(c for c in candidates if c != baseline))
    costs = [overhead + fewest(c) * step_s[baseline] * scale(c) for c in todo]
    fits = fitting(costs, screen_end - clock())
    if not fits and costs and costs[0] <= deadline - clock():
        # A race of the configured settings alone decides nothing: the likeliest
        # candidate gets the time left, and the first round decides.
        fits, screen_end = 1, deadline
    dropped.extend(todo[fits:])
    todo = todo[:fits]
    base_rate = runs[0].rate
    first: dict[Candidate, float] = {}
    index = 0
    spare = 1 if len(todo) >= 3 else 0  # a share kept for the winners together
    while index < len(todo):
        candidate = todo[index]
        left = len(todo) - index + spare
        # An equal share, or the candidate's fewest steps when the share is shorter (the
        # likeliest first get their run; a later one that no longer fits is dropped).
        seconds = min(max((screen_end - clock()) / left, least(candidate)), screen_end - clock())
        run = one(candidate, 1, seconds)
        if run is None:
            dropped.append(candidate)
        else:
            first[candidate] = run.rate
        index += 1
        if index == len(todo):
            union = _together(first, base_rate, baseline)
            if union is not None and union not in todo:
                todo.append(union)
            spare = 0
    # Round 2: the configured settings and the finalists, longer, side by side; again
    # while a whole round still fits (the runs are then the whole real run: repeats
    # average out other load), at most MAX_FINAL_ROUNDS times.
    finalists = sorted(first, key=lambda c: (-first[c], c.cost()))[:FINALISTS]
    order = [baseline, *finalists]
    finals: dict[Candidate, list[RaceRun]] = {}
    for round_index in range(2, 2 + MAX_FINAL_ROUNDS):
        share = (deadline - clock()) / len(order)
        if round_index > 2 and any(
            (plan(c, share) or 0) < finals[c][-1].figures.steps for c in order
        ):
            # Another round as long as the last does not fit: shorter runs weigh each
            # run's fixed costs more (a first optimizer step, a cold cache), the faster
            # candidate's most, and averaged in they under-predicted its speed-up.
            break
        # Alternated (configured first, then last, ...): a drift of other load over the
        # rounds then weighs on both sides of the paired ratios alike.
        ordered = order if round_index % 2 == 0 else order[::-1]
        for position, candidate in enumerate(ordered):
            seconds = (deadline - clock()) / (len(order) - position)
            if candidate == baseline and round_index == 2:
                # Its fewest steps at least: the configured settings' only other run is
                # the calibration, the process's first (one-off costs in it: a 1.85x
                # predicted, 1.13x real), and a comparison without them decides nothing.
                seconds = min(max(seconds, least(candidate)), deadline - clock())
            run = one(candidate, round_index, seconds)
            if run is not None:
                finals.setdefault(candidate, []).append(run)
        if len(finals) < len(order):
            break
    if baseline in finals and len(finals) > 1:
        pool = paired_gains(finals, baseline)
        reference = finals[baseline][-1]
    else:  # no whole last round: the configured settings' latest run, the others' longest
        reference = finals[baseline][-1] if baseline in finals else runs[0]
        longest = {c: max((r for r in runs if r.candidate == c), key=_steps) for c in first}
        pool = {baseline: reference.rate, **{c: run.rate for c, run in longest.items()}}
        finals = {c: [run] for c, run in longest.items()}
    best = max(pool, key=lambda c: (pool[c], -len(c.settings())))
    winner_run = finals[best][-1] if best in finals else reference
    gain = pool[best] / pool[baseline] if pool[baseline] > 0 else 1.0
    return PipelineRace(
        runs=tuple(runs),
        winner=best,
        gain=gain,
        baseline_figures=reference.figures,
        winner_figures=winner_run.figures,
        dropped=tuple(dropped),
    )


def _steps(run: RaceRun) -> int:
    return run.figures.steps


def _together(
    rates: dict[Candidate, float], base_rate: float, baseline: Candidate
) -> Candidate | None:
    """The best loader settings that won with every other change that won, when that
    makes two or more changes together (None otherwise)."""
    winners = [c for c, rate in rates.items() if rate > MIN_GAIN * base_rate]
    if not winners:
        return None
    loaders = [c for c in winners if not c.settings()]
    best_loader = max(loaders, key=rates.__getitem__) if loaders else baseline
    if "data.cache" in {k for c in winners for k in c.settings()}:
        best_loader = max(
            (c.loader() for c in winners if c.cache is not None), key=lambda c: c.cost()
        )
    others: dict[str, Any] = {}
    for candidate in sorted(winners, key=lambda c: rates[c]):  # the best's value last
        others.update(
            {
                field: getattr(candidate, field)
                for field in ("cache", "fused", "threads")
                if getattr(candidate, field) is not None
            }
        )
    parts = len(others) + (best_loader.loader() != baseline.loader())
    if parts < 2:
        return None
    return dataclasses.replace(best_loader, **others)


# --- the facts and configs of candidates ------------------------------------------------


def config_with(config: RunConfig, candidate: Candidate) -> RunConfig:
    """``config`` with the candidate's loader settings and its other changes."""
    update: dict[str, Any] = {
        key: value
        for key, value in candidate.overrides().items()
        if key in LoaderConfig.model_fields
    }
    changed = config.model_copy(update={"loader": config.loader.model_copy(update=update)})
    return apply_settings(changed, candidate.settings())


def facts_of(
    config: RunConfig,
    pipeline: Pipeline,
    model: Any,
    *,
    fetch: Any,
    calibration: PipelineFigures,
    in_memory: bool,
) -> Facts:
    """The facts :func:`other_changes` decides from (``left_s`` left at 0)."""
    data = pipeline.train_data
    length = length_or_none(data)
    optimizer = build_optimizer(copy.deepcopy(model), config.optim, device=pipeline.device)
    return Facts(
        device=pipeline.device.type,
        cores=usable_cores(),
        workers=config.loader.num_workers,
        threads=calibration.threads,
        optimizer=config.optim.name,
        fused=bool(optimizer.defaults.get("fused")),
        cache=config.data.cache,
        length=length,
        in_memory=in_memory or isinstance(data, ArrayDataset),
        per_sample_s=fetch.per_sample_s if fetch is not None else None,
        fill_sample_s=fetch.fill_per_sample_s if fetch is not None else None,
        sample_bytes=_sample_bytes(data) if length else None,
        free_bytes=psutil.virtual_memory().available,
        epochs=config.train.epochs,
        left_s=0.0,
    )


def _sample_bytes(data: Any) -> int | None:
    """The bytes of one sample's tensors and arrays (None when it holds none)."""
    try:
        sample = data[0]
    except Exception:
        return None
    fields = sample.values() if isinstance(sample, dict) else sample
    if not isinstance(fields, (tuple, list)):
        fields = (fields,)
    total = 0
    for value in fields:
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif hasattr(value, "nbytes"):
            total += int(value.nbytes)
    return total or None


def candidate_scale(candidate_config: RunConfig, config: RunConfig) -> float:
    """A step's cost relative to the configured one (by batch size)."""
    return candidate_config.loader.batch_size / config.loader.batch_size


def changed_settings(
    config: RunConfig, baseline: Candidate, winner: Candidate, *, cuda: bool
) -> dict:
    """The dotted keys whose winning value differs from the config's."""
    wanted: dict[str, Any] = {
        "loader.num_workers": winner.num_workers,
        "loader.prefetch_factor": winner.prefetch_factor if winner.num_workers else None,
        "loader.persistent_workers": winner.persistent_workers if winner.num_workers else False,
    }
    if cuda and winner.pin_memory != baseline.pin_memory:
        wanted["loader.pin_memory"] = winner.pin_memory
    if winner.batch_size is not None:
        wanted["loader.batch_size"] = winner.batch_size
    wanted.update(winner.settings())
    current = {
        f"{section}.{key}": value
        for section in ("loader", "data", "optim", "train")
        for key, value in getattr(config, section).model_dump().items()
    }
    return {key: value for key, value in wanted.items() if current.get(key) != value}
