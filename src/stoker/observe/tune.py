"""Loader autotuner: successive halving ranks loader settings by the loader alone, short
training runs of the whole pipeline pick the winner and predict its speed-up."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from stoker.config import LoaderConfig, RunConfig
from stoker.data.loader_fast import serves_in_process
from stoker.observe.halving import (
    Candidate,
    Halving,
    Trial,
    halving_cost,
    search_space,
    successive_halving,
)
from stoker.observe.short_run import (
    PipelineFigures,
    measure_pipeline,
    warmup_steps,
)
from stoker.observe.stages import (
    PerSampleView,
    burst_size,
    copy_to,
    measure_fetch,
    measure_loader,
    usable_cores,
    warmup_batches,
)
from stoker.observe.yaml_edit import write_loader_settings
from stoker.train.pipeline import Pipeline, UserComponents, build_pipeline, build_train_loader

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
]

logger = logging.getLogger("stoker")

#: The worker-count warning PyTorch gives above the core count: measuring that is the point.
_WORKER_WARNING = ".*worker processes in total.*"


class LoaderMeasure:
    """``measure(candidate, seconds)``: the training loader alone with those settings.

    With an accelerator each batch is also copied to it (non-blocking, then waited
    for), so pinned memory shows its worth.
    """

    def __init__(self, config: RunConfig, pipeline: Pipeline, *, repeats: int = 3) -> None:
        self.config = config
        self.pipeline = pipeline
        self.repeats = repeats

    def __call__(self, candidate: Candidate, seconds: float) -> float:
        pipeline = self.pipeline
        data = PerSampleView(pipeline.train_data) if candidate.per_sample else pipeline.train_data
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_WORKER_WARNING)
            loader = build_train_loader(
                self.config,
                data,
                device=pipeline.device,
                collate_fn=pipeline.collate_fn,
                **candidate.overrides(),
            )
            rate = measure_loader(
                loader,
                seconds=seconds,
                repeats=self.repeats,
                warmup_batches=warmup_batches(candidate.num_workers, candidate.prefetch_factor),
                burst=burst_size(candidate.num_workers, candidate.prefetch_factor),
                consume=copy_to(pipeline.device),
                # Warm-up and bursts included, a candidate costs at most twice its share.
                max_s=2 * seconds + 0.05,
            )
        return rate.samples_per_s


def config_with(config: RunConfig, candidate: Candidate) -> RunConfig:
    """``config`` with the candidate's loader settings."""
    update: dict[str, Any] = {
        key: value
        for key, value in candidate.overrides().items()
        if key in LoaderConfig.model_fields
    }
    return config.model_copy(update={"loader": config.loader.model_copy(update=update)})


@dataclass(frozen=True)
class TuneResult:
    """What ``stoker tune`` found.

    Attributes:
        baseline: The configured settings.
        winner: The fastest settings measured.
        halving: Every measurement and what was abandoned when.
        settings: The ``loader.*`` keys that differ from the config (what ``--write`` saves).
        notes: What was fixed and why (pinning on CPU, batched fetch as code advice).
        search_s: Wall time of the search.
        final_s: Seconds per candidate in the last round.
        baseline_pipeline: A short training run with the configured settings.
        winner_pipeline: The same with the winner's settings.
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

    @property
    def pipeline_gain(self) -> float | None:
        """The speed-up a real run of the configured epochs shows with the winner: both
        short runs' rates over whole epochs, each epoch's start-up paid as a run pays it."""
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
        }


def _asdict(figures: PipelineFigures | None) -> dict[str, Any] | None:
    return None if figures is None else dataclasses.asdict(figures)


def _settings(config: RunConfig, baseline: Candidate, winner: Candidate, *, cuda: bool) -> dict:
    """The ``loader.*`` keys whose winning value differs from the config's."""
    wanted: dict[str, Any] = {
        "num_workers": winner.num_workers,
        "prefetch_factor": winner.prefetch_factor if winner.num_workers else None,
        "persistent_workers": winner.persistent_workers if winner.num_workers else False,
    }
    if cuda and winner.pin_memory != baseline.pin_memory:
        wanted["pin_memory"] = winner.pin_memory
    if winner.batch_size is not None:
        wanted["batch_size"] = winner.batch_size
    current = config.loader.model_dump()
    return {key: value for key, value in wanted.items() if current.get(key) != value}


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
    """Search the loader settings of ``config`` within about ``budget_s`` seconds.

    About 45% of the budget goes to successive halving over the loader alone (cheap:
    no model), which ranks the candidates; the rest to short training runs of the whole
    pipeline, the configured settings and the best few candidates, which pick the
    winner. Its predicted speed-up is the one those runs show over whole epochs.

    Args:
        config: The run config.
        budget_s: Total time to spend, building the pipeline, search and confirming runs.
        batch_size: Also search the batch size (half, double, quadruple). It changes the
            optimisation, not only speed, so it is off unless asked for, and a winner
            with another batch size comes with a note on scaling the learning rate.
        confirm: Pick the winner by short training runs (off: the fastest loader alone,
            with no predicted gain).
        user: Python objects in place of config names.
        max_workers: Cap of the worker counts tried (besides the configured one).
        say: Called with a line before each phase (progress for people).
    """
    started = time.perf_counter()
    say = say or (lambda line: logger.debug(line))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_WORKER_WARNING)
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
    if not batched:
        notes.append(
            "the dataset fetches one sample at a time; a __getitems__ that returns whole "
            "batches (or a stoker ArrayDataset) is a code change the tuner cannot make"
        )
    sizes: list[int] = []
    if batch_size:
        base = loader_cfg.batch_size
        sizes = sorted({max(1, base // 2), base * 2, base * 4} - {base})
    fetch = measure_fetch(
        pipeline.train_data, batch_size=loader_cfg.batch_size, collate_fn=None, seconds=0.1
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
    if serves_in_process(pipeline.train_data, batched=batched):
        # Every worker count would measure the same in-process loader (build_loader
        # serves in-memory arrays without workers): only noise could pick among them.
        space = [candidate for candidate in space if candidate.num_workers == 0]
        notes.append(
            "in-memory arrays are served in-process whatever num_workers says (see the "
            "loader's note): worker counts, prefetch_factor and persistent_workers are "
            "not searched, and num_workers is set to 0"
        )
    calibration = None
    if confirm:
        # The shortest run of the configured settings first: it times a step of the whole
        # pipeline (the loader alone does not see compute), which sizes everything after.
        say("timing a training step of the configured settings")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_WORKER_WARNING)
            calibration = measure_pipeline(config, pipeline, model, steps=warmup_steps(config) + 4)
    left_s = budget_s - (time.perf_counter() - started)
    search_budget = max(0.1, left_s * (SEARCH_SHARE if confirm else 0.9))
    # Each measurement also pays start-up and warm-up (0.1 s to seconds with many
    # workers); successive halving takes about 1.35 measurements per candidate, and
    # shortens its later rounds when they would overrun.
    overhead_s = 0.3 * 1.35 * len(space)
    final_s = max(0.2, (search_budget - overhead_s) / halving_cost(len(space)))
    say(f"{len(space)} candidates, successive halving, {final_s:.1f} s each in the last round")
    measure = LoaderMeasure(config, pipeline)
    search_started = time.perf_counter()
    halving = successive_halving(space, measure, final_s=final_s, deadline_s=search_budget)
    search_s = time.perf_counter() - search_started
    winner = halving.winner
    result = TuneResult(
        baseline=baseline,
        winner=winner,
        halving=halving,
        settings={},
        notes=(),
        search_s=search_s,
        final_s=final_s,
        epochs=config.train.epochs,
    )
    if confirm:
        deadline = started + 0.95 * budget_s  # a margin: a run can end a little late
        assert calibration is not None
        result = confirm_by_training(
            result, config, pipeline, model, calibration, deadline=deadline, say=say
        )
        winner = result.winner
    if winner.per_sample:
        notes.append("per-sample fetch measured faster than batched fetch for this dataset")
    settings = {} if result.rejected else _settings(config, baseline, winner, cuda=cuda)
    if "batch_size" in settings:
        old, new = loader_cfg.batch_size, settings["batch_size"]
        notes.append(
            f"loader.batch_size {old} -> {new} changes the optimisation, not only the speed: "
            f"each step averages {new} samples and there are {old / new:.2g}x as many steps "
            f"per epoch; scale the learning rate with it (linear scaling: optim.lr="
            f"{config.optim.lr * new / old:.3g}) and compare the loss curves"
        )
    return dataclasses.replace(result, settings=settings, notes=(*notes, *result.notes))


#: The share of the budget (after building the pipeline) successive halving gets.
SEARCH_SHARE = 0.45
#: Candidates besides the configured settings confirmed by short training runs.
CONFIRMED = 3


def confirm_by_training(
    result: TuneResult,
    config: RunConfig,
    pipeline: Pipeline,
    model: Any,
    calibration: PipelineFigures,
    *,
    deadline: float,
    say: Callable[[str], None],
) -> TuneResult:
    """Short training runs of the configured settings and the best few candidates
    (by the loader alone), sized to end by ``deadline``; the fastest run wins, and a
    winner that is not more than 5% faster than the configured settings is rejected."""
    halving = result.halving
    ranked = sorted(
        (c for c in dict.fromkeys(t.candidate for t in halving.trials) if c != result.baseline),
        key=lambda c: (-(halving.last_trial(c).samples_per_s), c.cost()),  # type: ignore[union-attr]
    )
    shortlist = list(dict.fromkeys([result.winner, *ranked]))[:CONFIRMED]
    shortlist = [c for c in shortlist if c != result.baseline]
    runs: dict[Candidate, PipelineFigures] = {}
    order = [result.baseline, *shortlist]
    say(f"confirming: {len(order)} short training runs")
    # ``calibration``, the shortest run of the configured settings, sizes every run and
    # stands for the configured settings when a longer run does not fit.
    runs[result.baseline] = calibration
    per_step_s = calibration.epoch_s / max(calibration.steps, 1)
    overhead_s = max(0.0, calibration.wall_s - calibration.epoch_s)
    for index, candidate in enumerate(order):
        left = deadline - time.perf_counter()
        # What is left, shared by the runs still to go; each run also pays its set-up.
        seconds = left / (len(order) - index) - overhead_s
        run_config = config_with(config, candidate)
        fewest = warmup_steps(run_config) + 4
        if seconds < fewest * per_step_s * candidate_scale(run_config, config):
            continue  # does not fit: a run past the deadline would break the budget
        data = PerSampleView(pipeline.train_data) if candidate.per_sample else None
        scale = candidate_scale(run_config, config)
        steps = max(fewest, int(seconds / (per_step_s * scale)))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_WORKER_WARNING)
            runs[candidate] = measure_pipeline(
                run_config, pipeline, model, steps=steps, dataset=data
            )
        if candidate == result.baseline:
            per_step_s = runs[candidate].epoch_s / max(runs[candidate].steps, 1)
    base = runs[result.baseline]
    epochs = result.epochs
    rates = {c: f.run_rate(epochs) for c, f in runs.items()}
    best = max(rates, key=lambda c: (rates[c], -sum(map(float, c.cost()[:1]))))
    notes: list[str] = []
    rejected = best == result.baseline or rates[best] <= 1.05 * rates[result.baseline]
    if rejected and best != result.baseline:
        notes.append(
            f"no change: the best candidate trained at {rates[best]:,.0f} samples/s vs "
            f"{rates[result.baseline]:,.0f} with the current settings (not 5% faster)"
        )
    elif rejected:
        notes.append("no change: the current settings trained fastest")
    return dataclasses.replace(
        result,
        winner=best if not rejected else result.winner,
        baseline_pipeline=base,
        winner_pipeline=runs[best],
        rejected=rejected,
        notes=tuple(notes),
        confirmed={c: rates[c] / rates[result.baseline] for c in runs},
    )


def candidate_scale(candidate_config: RunConfig, config: RunConfig) -> float:
    """A step's cost relative to the configured one (by batch size)."""
    return candidate_config.loader.batch_size / config.loader.batch_size


# --- writing the winner into the config ------------------------------------------------
