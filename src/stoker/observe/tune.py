"""The autotuner: successive halving ranks loader settings by the loader alone; a race of
short training runs of the whole pipeline, the doctor's other changes included (cache,
fused optimizer, thread count), picks the winner and predicts its speed-up."""

from __future__ import annotations

import copy
import dataclasses
import gc
import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker.config import RunConfig
from stoker.data.loader_fast import serves_in_process
from stoker.data.sources import length_or_none
from stoker.observe.halving import (
    Candidate,
    Halving,
    Trial,
    halving_cost,
    likeliest_first,
    search_space,
    successive_halving,
)
from stoker.observe.proposals import MIN_GAIN
from stoker.observe.short_run import (
    PipelineFigures,
    cached_data,
    measure_pipeline,
    warmup_steps,
)
from stoker.observe.stages import (
    PerSampleView,
    measure_fetch,
    usable_cores,
)
from stoker.observe.tune_loader import WORKER_WARNING, LoaderMeasure
from stoker.observe.tune_plan import (
    cache_first,
    code_change_notes,
    import_optimizer_stack,
    likely_workers,
)
from stoker.observe.tune_search import (
    PipelineRace,
    candidate_scale,
    changed_settings,
    config_with,
    facts_of,
    other_changes,
    race,
    shortlist,
)
from stoker.observe.yaml_edit import write_loader_settings, write_settings
from stoker.train.pipeline import Pipeline, UserComponents, build_pipeline

__all__ = [
    "Candidate",
    "Halving",
    "LoaderMeasure",
    "Trial",
    "TuneResult",
    "halving_cost",
    "search_space",
    "successive_halving",
    "tune",
    "write_loader_settings",
    "write_settings",
]

logger = logging.getLogger("stoker")

#: The worker-count warning PyTorch gives above the core count: measuring that is the point.


@dataclass(frozen=True)
class TuneResult:
    """What ``stoker tune`` found.

    Attributes:
        baseline: The configured settings.
        winner: The fastest settings measured.
        halving: Every measurement and what was abandoned when.
        settings: The dotted keys whose winning value differs from the config
            (``loader.num_workers``, ``data.cache``, ``optim.fused``, ``train.threads``):
            what ``--write`` saves.
        notes: What was fixed and why (pinning on CPU, batched fetch as code advice).
        search_s: Wall time of the search.
        final_s: Seconds per candidate in the last round.
        baseline_pipeline: A short training run with the configured settings.
        winner_pipeline: The same with the winner's settings, in the same round.
        race: Every short training run (None without confirming runs).
        timings: Seconds per phase of the tuner (building, calibrating, searching,
            racing): where its budget went.
    """

    baseline: Candidate
    winner: Candidate
    halving: Halving
    settings: dict[str, Any]
    notes: tuple[str, ...]
    search_s: float
    final_s: float
    baseline_pipeline: PipelineFigures | None = None
    winner_pipeline: PipelineFigures | None = None
    rejected: bool = False
    epochs: int = 1
    confirmed: dict[Candidate, float] = dataclasses.field(default_factory=dict)
    race: PipelineRace | None = None
    timings: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def pipeline_gain(self) -> float | None:
        """The speed-up a real run of the configured epochs shows with the winner: the
        short runs' rates over the whole run (each epoch's start-up and shutdown, a
        cache's fill once), as a real run pays them, not a steady epoch's; the mean of
        the race's last rounds, winner and configured settings side by side."""
        if self.race is not None and self.winner == self.race.winner:
            return self.race.gain
        return self.figures_gain

    @property
    def figures_gain(self) -> float | None:
        """:attr:`pipeline_gain` from the one pair of runs ``baseline_pipeline`` and
        ``winner_pipeline``."""
        if self.baseline_pipeline is None or self.winner_pipeline is None:
            return None
        base = self.baseline_pipeline.run_rate(self.epochs)
        return self.winner_pipeline.run_rate(self.epochs) / base if base > 0 else None

    @property
    def predicted_gain(self) -> float | None:
        """What ``stoker tune`` predicts for training with ``settings``: the confirmed
        pipeline gain, 1.0 when nothing changes, None when nothing was confirmed."""
        if not self.settings:
            return 1.0
        return self.pipeline_gain

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready data: the table rows, the winner, the settings and the confirmation."""
        rows = []
        for candidate in dict.fromkeys(t.candidate for t in self.halving.trials):
            trial = self.halving.last_trial(candidate)
            assert trial is not None
            rows.append(
                {
                    "candidate": candidate.label(),
                    "settings": dataclasses.asdict(candidate),
                    "rounds": trial.round + 1,
                    "samples_per_s": trial.samples_per_s,
                    "status": self.halving.status(candidate),
                }
            )
        return {
            "winner": dataclasses.asdict(self.winner),
            "baseline": dataclasses.asdict(self.baseline),
            "settings": self.settings,
            "rejected": self.rejected,
            "notes": list(self.notes),
            "search_s": self.search_s,
            "final_s": self.final_s,
            "measured_s": self.halving.spent_s,
            "pipeline_gain": self.pipeline_gain,
            "predicted_gain": self.predicted_gain,
            "epochs": self.epochs,
            "baseline_pipeline": _asdict(self.baseline_pipeline),
            "winner_pipeline": _asdict(self.winner_pipeline),
            "candidates": rows,
            "training_runs": [
                {
                    "candidate": run.candidate.label(),
                    "round": run.round,
                    "steps": run.figures.steps,
                    "samples_per_s": run.rate,
                    "cut_short": run.figures.cut_short,
                }
                for run in (self.race.runs if self.race else ())
            ],
            "timings": self.timings,
        }


def _asdict(figures: PipelineFigures | None) -> dict[str, Any] | None:
    return None if figures is None else dataclasses.asdict(figures)


#: The share of the budget (after building and calibrating) the loader-alone search gets
#: when short training runs follow (they get the rest).
SEARCH_SHARE = 0.2
#: The most of the budget the first run, of the configured settings, may take.
CALIBRATE_SHARE = 0.25
#: The share of the budget the last training run may end by (tearing it down follows).
DEADLINE_SHARE = 0.95


def tune(
    config: RunConfig,
    *,
    budget_s: float = 60.0,
    batch_size: bool = False,
    confirm: bool = True,
    user: UserComponents | None = None,
    max_workers: int = 16,
    say: Callable[[str], None] | None = None,
) -> TuneResult:
    """Search the settings of ``config`` that speed training, within ``budget_s`` seconds.

    First a few training steps of the configured settings time a step of the whole
    pipeline. Then successive halving over the loader settings alone (cheap: no model)
    ranks them. Then a race of short training runs of the whole pipeline: the best loader
    candidates, and the doctor's other changes (``data.cache=memory``,
    ``optim.fused=true``, ``train.threads``) on the configured and on the best loader
    settings, each briefly, then the configured settings and the best one again, longer
    (whole epochs when they fit), side by side; the winners together when several win.
    Every phase is planned against what is left of the budget. The predicted speed-up is
    the one the last round's runs show over the whole run of ``train.epochs`` epochs.

    Args:
        config: The run config.
        budget_s: Total time to spend, building the pipeline, search and training runs.
        batch_size: Also search the batch size (half, double, quadruple). It changes the
            optimisation, not only speed, so it is off unless asked for, and a winner
            with another batch size comes with a note on scaling the learning rate.
        confirm: Pick the winner by short training runs (off: the fastest loader alone,
            with no predicted gain, and none of the other changes).
        user: Python objects in place of config names.
        max_workers: Cap of the worker counts tried (besides the configured one).
        say: Called with a line before each phase (progress for people).
    """
    import_optimizer_stack()
    started = time.perf_counter()
    say = say or (lambda line: logger.debug(line))
    timings: dict[str, float] = {}
    gc.collect()  # loaders left over in this process stop before any worker forks
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=WORKER_WARNING)
        pipeline = build_pipeline(config, user or UserComponents())
    model = copy.deepcopy(pipeline.model)
    device = pipeline.device
    cuda = device.type == "cuda"
    dataloader = pipeline.train_loader.dataloader
    loader_cfg = config.loader
    baseline = Candidate(
        num_workers=loader_cfg.num_workers,
        prefetch_factor=loader_cfg.prefetch_factor if loader_cfg.num_workers else None,
        persistent_workers=loader_cfg.persistent_workers and loader_cfg.num_workers > 0,
        pin_memory=bool(dataloader.pin_memory),
    )
    notes = []
    if not cuda:
        notes.append(
            f"pin_memory fixed off: it only speeds host-to-GPU copies, and this run trains "
            f"on {device.type}"
        )
    batched = pipeline.train_loader.returns_batches
    sizes: list[int] = []
    if batch_size:
        base = loader_cfg.batch_size
        sizes = sorted({max(1, base // 2), base * 2, base * 4} - {base})
    # The run's own collate_fn, timed beside dataset[i]: the likely worker count spreads
    # both (a costly collate measured as default_collate's few µs asked for 1 worker).
    fetch = measure_fetch(
        pipeline.train_data,
        batch_size=loader_cfg.batch_size,
        collate_fn=pipeline.collate_fn,
        seconds=0.1,
    )
    space = search_space(
        cores=usable_cores(),
        baseline=baseline,
        cuda=cuda,
        batched=batched,
        batch_sizes=sizes,
        max_workers=max_workers,
        cpu_share=fetch.cpu_share if fetch is not None else None,
    )
    in_process = serves_in_process(pipeline.train_data, batched=batched)
    if in_process:
        # Every worker count would measure the same in-process loader (build_loader
        # serves in-memory arrays without workers): only noise could pick among them.
        space = [candidate for candidate in space if candidate.num_workers == 0]
        notes.append(
            "in-memory arrays are served in-process whatever num_workers says (see the "
            "loader's note): worker counts, prefetch_factor and persistent_workers are "
            "not searched, and num_workers is set to 0"
        )
    timings["build_s"] = time.perf_counter() - started
    calibration = None
    code_notes: list[str] = []
    likely: Candidate | None = None
    changes: list[dict[str, Any]] = []
    if confirm:
        # The shortest run of the configured settings first: it times a step of the whole
        # pipeline (the loader alone does not see compute), which sizes everything after.
        say("timing a training step of the configured settings")
        mark = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=WORKER_WARNING)
            calibration = measure_pipeline(
                config,
                pipeline,
                model,
                steps=warmup_steps(config) + 4,
                # Many slow workers' prefetched burst took 4.4 s of an 8 s budget.
                deadline=started + CALIBRATE_SHARE * budget_s,
                min_steps=4,  # a step time to plan from, past the first
            )
        timings["calibrate_s"] = time.perf_counter() - mark
        facts = facts_of(
            config, pipeline, model, fetch=fetch, calibration=calibration, in_memory=in_process
        )
        facts = dataclasses.replace(facts, left_s=budget_s - (time.perf_counter() - started))
        changes, skipped = other_changes(facts)
        notes.extend(skipped)
        code_notes = code_change_notes(fetch, calibration, batched=batched)
        workers = likely_workers(
            fetch,
            calibration,
            batch_size=loader_cfg.batch_size,
            cores=usable_cores(),
            cap=max_workers,
            batches=calibration.epoch_samples // loader_cfg.batch_size or None,
            epochs=config.train.epochs,
        )
        if workers is not None and not in_process:
            # Measured first, and raced: a tight budget measures only a few of the
            # ~20 worker counts, each for a moment (too short for many workers).
            space = likeliest_first(space, workers)
            likely = Candidate(workers, None, True, baseline.pin_memory)
    left_s = budget_s - (time.perf_counter() - started)
    search_budget = max(0.1, left_s * (SEARCH_SHARE if confirm else 0.9))
    if len(space) == 1:
        search_budget = min(search_budget, 0.3)  # one candidate: nothing to rank
    # Each measurement also pays start-up and warm-up (0.1 s to seconds with many
    # workers); successive halving takes about 1.35 measurements per candidate, and
    # shortens its later rounds when they would overrun.
    overhead_s = 0.3 * 1.35 * len(space)
    final_s = max(0.2, (search_budget - overhead_s) / halving_cost(len(space)))
    final_s = min(final_s, search_budget)
    say(f"{len(space)} loader candidates, successive halving, {final_s:.1f} s each at most")
    measure = LoaderMeasure(config, pipeline)
    search_started = time.perf_counter()
    halving = successive_halving(space, measure, final_s=final_s, deadline_s=search_budget)
    search_s = time.perf_counter() - search_started
    timings["loader_search_s"] = search_s
    result = TuneResult(
        baseline=baseline,
        winner=halving.winner,
        halving=halving,
        settings={},
        notes=(),
        search_s=search_s,
        final_s=final_s,
        epochs=config.train.epochs,
    )
    if confirm:
        assert calibration is not None
        mark = time.perf_counter()
        result = confirm_by_training(
            result,
            config,
            pipeline,
            model,
            calibration,
            changes=changes,
            likely=likely,
            cache_first=cache_first(
                fetch,
                calibration,
                length=length_or_none(pipeline.train_data),
                epochs=config.train.epochs,
                loader_rate=max(
                    (t.samples_per_s for t in halving.trials if t.candidate.num_workers),
                    default=0.0,
                ),
            ),
            deadline=started + DEADLINE_SHARE * budget_s,
            say=say,
        )
        timings["training_runs_s"] = time.perf_counter() - mark
    winner = result.winner
    if result.halving.winner.per_sample:
        notes.append("per-sample fetch measured faster than batched fetch for this dataset")
    settings = {} if result.rejected else changed_settings(config, baseline, winner, cuda=cuda)
    if "loader.batch_size" in settings:
        old, new = loader_cfg.batch_size, settings["loader.batch_size"]
        notes.append(
            f"loader.batch_size {old} -> {new} changes the optimisation, not only the speed: "
            f"each step averages {new} samples and there are {old / new:.2g}x as many steps "
            f"per epoch; scale the learning rate with it (linear scaling: optim.lr="
            f"{config.optim.lr * new / old:.3g}) and compare the loss curves"
        )
    if settings.get("data.cache") == "memory" and result.winner_pipeline is not None:
        fill = result.winner_pipeline.prepare_s
        notes.append(
            f"data.cache=memory: filling the cache took {fill:.1f} s before the first epoch "
            "(counted in the speed-up, over the run's epochs); the decoded samples stay in "
            "memory, and every epoch sees the first one's samples (no random augmentation "
            "before the cache)"
        )
        if calibration is not None:  # the cache serves whole batches: no fetch to fix
            code_notes = code_change_notes(fetch, calibration, batched=True)
    timings["total_s"] = time.perf_counter() - started
    # A code change the figures call for comes first: the "no change" or small gain
    # below is the best of what config can express, not of what the run can reach.
    return dataclasses.replace(
        result, settings=settings, notes=(*code_notes, *notes, *result.notes), timings=timings
    )


def confirm_by_training(
    result: TuneResult,
    config: RunConfig,
    pipeline: Pipeline,
    model: Any,
    calibration: PipelineFigures,
    *,
    changes: list[dict[str, Any]],
    deadline: float,
    say: Callable[[str], None],
    likely: Candidate | None = None,
    cache_first: bool = False,
) -> TuneResult:
    """The race of short training runs (see :func:`stoker.observe.tune_search.race`) over
    the best loader candidates and the other changes; a winner not more than 5% faster
    than the configured settings is rejected."""
    halving = result.halving
    ranked = sorted(
        dict.fromkeys(t.candidate for t in halving.trials),
        key=lambda c: (-(halving.last_trial(c).samples_per_s), c.cost()),  # type: ignore[union-attr]
    )
    # The worker count the figures say keeps up with the step (persistent) is raced
    # second whatever the loader alone measured of it in its moment.
    ranked = list(dict.fromkeys([result.winner, *([likely] if likely else []), *ranked]))
    # Per-sample fetch of a batched dataset has no setting to write: a winner raced with
    # it would predict a speed the written settings do not give.
    ranked = [c for c in ranked if not c.per_sample]
    candidates = shortlist(
        ranked, result.baseline, changes, phases=calibration.phases, cache_first=cache_first
    )
    say(f"racing {len(candidates)} candidates and the current settings in short training runs")
    cached: dict[str, tuple[Any, float]] = {}

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures | None:
        run_config = config_with(config, candidate)
        data = PerSampleView(pipeline.train_data) if candidate.per_sample else None
        fill_s = 0.0
        if candidate.cache == "memory":
            if "memory" not in cached:  # filled once, its time charged to every run
                filling = time.perf_counter()
                cached["memory"] = cached_data(run_config, pipeline.train_data)
                # Charged as prepare_s, not its steps' time (a fill cut its run to 1 step).
                until = min(deadline, until + time.perf_counter() - filling)
            data, fill_s = cached["memory"]
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=WORKER_WARNING)
            figures = measure_pipeline(
                run_config, pipeline, model, steps=steps, dataset=data, deadline=until
            )
        return dataclasses.replace(figures, prepare_s=fill_s) if fill_s else figures

    def per_epoch(candidate: Candidate) -> int | None:
        run_config = config_with(config, candidate)
        length = length_or_none(pipeline.train_data)
        if length is None:
            return None
        size = run_config.loader.batch_size
        batches = length // size if run_config.loader.drop_last else math.ceil(length / size)
        return max(1, math.ceil(batches / run_config.train.grad_accum_steps))

    raced = race(
        candidates,
        result.baseline,
        calibration,
        measure,
        deadline=deadline,
        epochs=result.epochs,
        epoch_steps=per_epoch,
        fewest=lambda c: warmup_steps(config_with(config, c)) + 4,
        scale=lambda c: candidate_scale(config_with(config, c), config),
    )
    base_rate = raced.baseline_figures.run_rate(result.epochs)
    best_rate = raced.winner_figures.run_rate(result.epochs)
    notes: list[str] = []
    rejected = raced.winner == result.baseline or raced.gain <= MIN_GAIN
    if rejected and raced.winner != result.baseline:
        notes.append(
            f"no change: the best candidate trained at {best_rate:,.0f} samples/s vs "
            f"{base_rate:,.0f} with the current settings (not 5% faster)"
        )
    elif rejected:
        notes.append("no change: the current settings trained fastest")
    if raced.dropped:
        notes.append(
            f"{len(raced.dropped)} candidate(s) not run for lack of time: "
            + "; ".join(c.label() for c in raced.dropped)
        )
    winner_figures = raced.winner_figures if not rejected else raced.baseline_figures
    return dataclasses.replace(
        result,
        winner=raced.winner if not rejected else result.baseline,
        baseline_pipeline=raced.baseline_figures,
        winner_pipeline=winner_figures,
        rejected=rejected,
        notes=tuple(notes),
        confirmed={c: rate / base_rate for c, rate in raced.rates().items() if base_rate > 0},
        race=raced,
    )
