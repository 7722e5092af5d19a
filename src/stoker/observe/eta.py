"""Time left: in the epoch and in the whole run, from the pace measured so far."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

__all__ = ["Eta", "format_duration"]

_UNKNOWN = "-"


class Eta:
    """Time left in the epoch and in the whole run, from the pace measured so far.

    The epoch's pace is its own steps over its own time; the run's is every step since
    the first epoch began over the time since, so validation, checkpoints and the gaps
    between epochs count in the run's ETA as they will in the rest of the run.

    ``run_steps`` (the run's optimizer steps, ``train.max_steps`` included) and
    ``steps_done`` (the steps already trained, on a resume) come from the session; without
    them the run is ``epochs × steps per epoch`` steps long.
    """

    def __init__(
        self,
        *,
        run_steps: int | None = None,
        steps_done: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_steps = run_steps
        self.clock = clock
        self.run_done = steps_done
        self.epoch = 1
        self.epochs = 1
        self.epoch_total: int | None = None
        self.epoch_done = 0
        self._resumed = steps_done  # steps before this process: part of the first epoch?
        self._run_start: float | None = None
        self._run_advanced = 0
        self._epoch_start = 0.0
        self._epoch_advanced = 0

    def start_epoch(self, epoch: int, *, epochs: int, total_steps: int | None) -> int:
        """Starts timing an epoch; returns the steps of it already done (a resume mid-epoch)."""
        now = self.clock()
        if self._run_start is None:
            self._run_start = now
        self.epoch, self.epochs, self.epoch_total = epoch, epochs, total_steps
        self._epoch_start, self._epoch_advanced = now, 0
        offset = 0
        if self._resumed and total_steps:
            # Every epoch has total_steps steps, so a resume lands this far into its epoch.
            offset = self._resumed - (epoch - 1) * total_steps
            offset = offset if 0 < offset < total_steps else 0
        self._resumed = 0
        self.epoch_done = offset
        return offset

    def advance(self, steps: int) -> None:
        """Count ``steps`` more done, in the epoch and in the run."""
        self.epoch_done += steps
        self.run_done += steps
        self._epoch_advanced += steps
        self._run_advanced += steps

    def epoch_eta_s(self) -> float | None:
        """Seconds left in this epoch, or None before its first step or without a length."""
        if self.epoch_total is None or not self._epoch_advanced:
            return None
        per_step = (self.clock() - self._epoch_start) / self._epoch_advanced
        return max(self.epoch_total - self.epoch_done, 0) * per_step

    def run_eta_s(self) -> float | None:
        """Seconds left in the run, or None before its first step or without a length."""
        if self._run_start is None or not self._run_advanced:
            return None
        if self.run_steps is not None:
            left = self.run_steps - self.run_done
        elif self.epoch_total is not None:
            left = self.epoch_total - self.epoch_done
            left += (self.epochs - self.epoch) * self.epoch_total
        else:
            return None
        per_step = (self.clock() - self._run_start) / self._run_advanced
        run_eta = max(left, 0) * per_step
        epoch_eta = self.epoch_eta_s()
        if epoch_eta is not None and left >= (self.epoch_total or 0) - self.epoch_done:
            # The run ends no sooner than this epoch: an epoch slower than the run so far
            # (its first steps, a loader warming up) would show "ETA 0:09  run 0:05".
            run_eta = max(run_eta, epoch_eta)
        return run_eta


def format_duration(seconds: float | None) -> str:
    """``0:42``, ``12:05``, ``1:02:03``; ``-`` when unknown."""
    if seconds is None or not math.isfinite(seconds):
        return _UNKNOWN
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
