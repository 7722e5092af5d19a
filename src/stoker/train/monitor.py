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
        if math.isnan(value):
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta


def update_monitor(loop: Loop, record: dict[str, Any]) -> None:
    """After an epoch: note whether its monitored metric is the best yet, and ask for an
    early stop after ``patience`` epochs without one."""
    state, monitor = loop.state, loop.monitor
    if monitor.metric not in record:
        raise TrainingError(
            f"train.monitor: metric {monitor.metric!r} was not produced; "
            f"this run records {', '.join(sorted(k for k in record if '/' in k))}",
            hint="set train.monitor to one of those",
        )
    value = float(record[monitor.metric])
    if monitor.improved(value, state.best_value):
        state.best_value, state.best_epoch = value, state.epoch
        state.epochs_without_improvement = 0
    else:
        state.epochs_without_improvement += 1
    if monitor.patience is not None and state.epochs_without_improvement >= monitor.patience:
        loop.stopped_early = True
        loop.progress.message(
            f"early stopping: {monitor.metric} has not improved for {monitor.patience} "
            f"epochs (best {state.best_value:.4f} at epoch {state.best_epoch})"
        )
