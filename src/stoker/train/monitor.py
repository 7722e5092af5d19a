"""The metric that picks the best epoch, and early stopping on it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from stoker.errors import TrainingError

if TYPE_CHECKING:
    from stoker.train.loop import Loop


@dataclass
class Monitor:
    """The metric that picks the best epoch and drives early stopping."""

    metric: str
    mode: Literal["min", "max"]
    patience: int | None = None
    min_delta: float = 0.0

    def improved(self, value: float, best: float | None) -> bool:
        """True when ``value`` beats ``best`` by more than ``min_delta`` (NaN never does)."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta


def update_monitor(loop: Loop, record: dict[str, Any]) -> None:
    """After an epoch: note whether its monitored metric is the best yet, and stop early
    after ``patience`` epochs without one — when there is an epoch left to skip.

    Patience that runs out with the last epoch (of ``train.epochs``, or at
    ``train.max_steps``) ends the run as planned: it is no early stop, and says nothing.
    """
    state, monitor = loop.state, loop.monitor
    if monitor.metric not in record:
        raise TrainingError(
            f"train.monitor: metric {monitor.metric!r} was not produced; "
            f"this run records {', '.join(sorted(k for k in record if '/' in k))}",
            hint="set train.monitor to one of those",
        )
    value = float(record[monitor.metric])
    if monitor.improved(value, state.best_value):
        state.best_value, state.best_epoch = value, state.epoch_number
        state.epochs_without_improvement = 0
    else:
        state.epochs_without_improvement += 1
    if monitor.patience is None or state.epochs_without_improvement < monitor.patience:
        return
    # state.epoch still counts this epoch as unfinished: epochs left after it, or none.
    if state.epoch_number >= loop.epochs or loop.out_of_steps():
        return
    loop.stopped_early = True
    best = (
        "no finite value yet"  # every value so far was NaN
        if state.best_value is None
        else f"best {state.best_value:.4f} at epoch {state.best_epoch}"
    )
    loop.progress.message(
        f"early stopping after epoch {state.epoch_number} of {loop.epochs}: "
        f"{monitor.metric} has not improved for {monitor.patience} epochs ({best})"
    )
