"""The tuner's loader-alone measurement: one candidate's loader settings, no model."""

from __future__ import annotations

import gc
import warnings

from stoker.config import RunConfig
from stoker.observe.halving import Candidate
from stoker.observe.stages import PerSampleView, copy_to, time_train_loader
from stoker.train.pipeline import Pipeline

__all__ = ["WORKER_WARNING", "LoaderMeasure"]

# PyTorch's warning about more workers than cores: the tuner tries such counts on purpose.
WORKER_WARNING = ".*worker processes in total.*"


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
        """Samples/s of the loader alone with ``candidate``'s settings, over ``seconds``."""
        pipeline = self.pipeline
        data = PerSampleView(pipeline.train_data) if candidate.per_sample else pipeline.train_data
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=WORKER_WARNING)
            rate = time_train_loader(
                self.config,
                pipeline,
                candidate.overrides(),
                data=data,
                seconds=seconds,
                repeats=self.repeats,
                consume=copy_to(pipeline.device),
                # Warm-up and bursts included, a candidate costs at most twice its share.
                max_s=2 * seconds + 0.05,
            )
        # Its loader's workers stop now, in this measurement's time: a loader left for the garbage
        # collector would stop in the middle of a later run, and workers forked before
        # then inherit it (its shutdown then waits seconds on them).
        gc.collect()
        return rate.samples_per_s
