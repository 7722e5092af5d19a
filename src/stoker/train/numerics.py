"""Numerical faults: what a NaN/inf loss or gradient does to a run, and fp16 overflow accounting.

Every step the loop asks the device one question — are the loss and every gradient
finite? — with one fused kernel per (device, dtype) and one read: the step's only
CPU–GPU sync. A step that fails it is a *fault*, handled by ``train.on_nonfinite``:

- ``halt`` (default): stop with an error naming the step and the first parameter whose
  gradient is not finite, before the optimizer touches anything.
- ``skip``: drop the step. The optimizer does not step, so the parameters and the
  optimizer state stay bitwise as they were; the step still counts (the lr schedule
  moves on, as it does for an fp16 overflow step). More than ``max_skipped_steps``
  in a run is an error: a run that keeps producing NaN has diverged.
- ``rollback``: restore model, optimizer, scheduler, scaler, counters and RNG from the
  newest valid checkpoint and go on with the batches *after* the bad one. Replaying
  them would replay the fault (the data order is fixed by the seed), so the updates
  since the checkpoint are lost and their batches are not revisited in this epoch.
  More than ``max_rollbacks`` is an error.

With fp16 loss scaling a non-finite gradient under a finite loss is an *overflow*: the
scaler skips the step and halves its scale, which is normal now and then. Overflow
steps are counted per epoch; a burst of them after training got going is a warning,
and a scale that falls below ``min_loss_scale`` is an error, not silent skipping.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from stoker.checkpoint import find_latest_valid, load_checkpoint
from stoker.errors import ConfigError, TrainingError
from stoker.train.grads import first_nonfinite_grad
from stoker.train.metrics import TaskMetrics

if TYPE_CHECKING:
    from stoker.train.loop import Loop

__all__ = [
    "BURST_STEPS",
    "NonfinitePolicy",
    "NumericsGuard",
    "Restored",
    "RollbackNeeded",
    "RolledBack",
    "check_step",
    "checkpoint_rollback",
    "describe_fault",
    "overflow_step",
    "roll_back",
]

logger = logging.getLogger("stoker")

NonfinitePolicy = Literal["halt", "skip", "rollback"]
_POLICIES = ("halt", "skip", "rollback")
#: Consecutive fp16 overflow steps, after the scale settled, that are worth a warning.
BURST_STEPS = 5
_HINT = "lower optim.lr, set train.clip_grad_norm, or check the data for NaN/inf values"


class RolledBack(Exception):
    """Not an error: a rollback restored the run; ``run`` trains on from the restored state."""


@dataclass(frozen=True)
class Restored:
    """What a rollback loaded: the checkpoint, and the history and epoch progress it held."""

    checkpoint: Path
    history: list[dict[str, Any]]
    in_epoch: dict[str, Any] | None


def checkpoint_rollback(
    directory: Path,
    restore: Callable[[dict[str, Any]], tuple[list[dict[str, Any]], Any]],
    *,
    before: Callable[[], None] | None = None,
) -> Callable[[], Restored | None]:
    """The ``Loop.rollback`` callback: restore the newest checkpoint that verifies.

    Args:
        directory: The run's checkpoints folder (or its run dir).
        restore: Loads a checkpoint bundle into the run's parts and returns
            ``(history, in-epoch progress)`` (``ResumableParts.restore``).
        before: Called first: finishes a save still being written (``async_save``), so
            that it is the newest checkpoint on every rank alike.

    Returns:
        A callable returning what it restored, or None when there is no checkpoint yet.
    """

    def rollback() -> Restored | None:
        if before is not None:
            before()
        found, damaged = find_latest_valid(directory)
        for folder, reason in damaged:
            logger.warning("checkpoint %s is damaged (%s); rolling back past it", folder, reason)
        if found is None:
            return None
        history, in_epoch = restore(load_checkpoint(found, verify=False))  # just verified
        return Restored(checkpoint=found, history=history, in_epoch=in_epoch)

    return rollback


def describe_fault(
    model: nn.Module, loss: torch.Tensor, *, step: int, epoch: int, loss_ok: bool
) -> Fault:
    """What went wrong at a bad step (reads the device: only called on a fault)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    return Fault(
        step=step,
        epoch=epoch,
        what="gradient" if loss_ok else "loss",
        loss=float(loss),
        grad_norm=norm,
        parameter=first_nonfinite_grad(model),
    )


@dataclass(frozen=True)
class Fault:
    """One step whose loss or gradients were not finite, described for people.

    ``step`` is the optimizer step it would have been and ``epoch`` the epoch it was in,
    both counted from 1 as the progress lines count them.
    """

    step: int
    epoch: int
    what: Literal["loss", "gradient"]
    loss: float
    grad_norm: float
    parameter: str | None

    def __str__(self) -> str:
        where = self.parameter or "none (the loss itself is not finite)"
        return (
            f"non-finite {self.what} at step {self.step} (epoch {self.epoch}): loss={self.loss}, "
            f"grad norm={self.grad_norm}; first parameter with a non-finite gradient: {where}"
        )


class NumericsGuard:
    """Applies ``train.on_nonfinite`` and keeps count of bad steps and fp16 overflows.

    Its counts live for the run: a rollback does not reset them (else a fault that
    repeats after every rollback would never reach the limit), and checkpoints carry
    them, so a resumed run does not get a fresh allowance either.
    """

    def __init__(
        self,
        policy: NonfinitePolicy = "halt",
        *,
        max_skipped_steps: int = 10,
        max_rollbacks: int = 3,
        min_loss_scale: float = 1.0,
        burst_steps: int = BURST_STEPS,
    ) -> None:
        if policy not in _POLICIES:
            raise ConfigError(
                f"train.on_nonfinite: {policy!r} is not one of {', '.join(_POLICIES)}",
                hint="set train.on_nonfinite=halt (or skip, or rollback)",
            )
        self.policy = policy
        self.max_skipped_steps = max_skipped_steps
        self.max_rollbacks = max_rollbacks
        self.min_loss_scale = min_loss_scale
        self.burst_steps = burst_steps
        #: Steps skipped and steps that caused a rollback in this process, in order.
        self.skipped_steps: list[int] = []
        self.rollback_steps: list[int] = []
        self._streak = 0  # consecutive fp16 overflow steps
        self._streak_first = 0  # the streak's first step
        self._streak_scale = 0.0  # the loss scale before the streak
        self._settled = False  # whether any step has updated the parameters yet
        self._epoch = {"skipped": 0, "overflow": 0, "rollbacks": 0}
        self._kept: tuple[Any, ...] | None = None  # TaskMetrics.snapshot()

    @classmethod
    def from_config(cls, train: Any) -> NumericsGuard:
        """From a ``TrainConfig`` (``on_nonfinite``, ``max_skipped_steps``, ...)."""
        return cls(
            train.on_nonfinite,
            max_skipped_steps=train.max_skipped_steps,
            max_rollbacks=train.max_rollbacks,
            min_loss_scale=train.min_loss_scale,
        )

    def state_dict(self) -> dict[str, list[int]]:
        """The steps skipped and rolled back so far (plain data, for checkpoints)."""
        return {
            "skipped_steps": list(self.skipped_steps),
            "rollback_steps": list(self.rollback_steps),
        }

    def load_state_dict(self, state: dict[str, list[int]] | None) -> None:
        """Continue the counts of a resumed run (None: a checkpoint from before they were kept)."""
        if state:
            self.skipped_steps = [int(step) for step in state.get("skipped_steps", [])]
            self.rollback_steps = [int(step) for step in state.get("rollback_steps", [])]

    # --- faults --------------------------------------------------------------------------

    def halt(self, fault: Fault) -> TrainingError:
        """The error that stops the run at ``fault``."""
        return TrainingError(str(fault), hint=_HINT)

    def count_skip(self, fault: Fault) -> str:
        """Count a skipped step; raises when the limit is used up. Returns the notice."""
        if len(self.skipped_steps) >= self.max_skipped_steps:
            raise TrainingError(
                f"{fault}; train.on_nonfinite=skip already skipped {len(self.skipped_steps)} "
                f"steps (train.max_skipped_steps={self.max_skipped_steps}): "
                f"steps {_listing(self.skipped_steps)}. A run that keeps producing inf/NaN has "
                "diverged or reads bad data",
                hint=f"{_HINT}; or raise train.max_skipped_steps",
            )
        self.skipped_steps.append(fault.step)
        self._epoch["skipped"] += 1
        return (
            f"warning: {fault}; skipped the step ({len(self.skipped_steps)} of at most "
            f"{self.max_skipped_steps}, train.max_skipped_steps)"
        )

    def count_rollback(self, fault: Fault) -> None:
        """Count a rollback; raises when the limit is used up."""
        if len(self.rollback_steps) >= self.max_rollbacks:
            raise TrainingError(
                f"{fault}; train.on_nonfinite=rollback already rolled back "
                f"{len(self.rollback_steps)} times (train.max_rollbacks={self.max_rollbacks}), "
                f"at steps {_listing(self.rollback_steps)}",
                hint=f"{_HINT}; or raise train.max_rollbacks",
            )
        self.rollback_steps.append(fault.step)
        self._epoch["rollbacks"] += 1

    def no_checkpoint(self, fault: Fault, *, enabled: bool) -> TrainingError:
        """The error for a rollback with nothing to roll back to."""
        if not enabled:
            return TrainingError(
                f"{fault}; train.on_nonfinite=rollback, but this run writes no checkpoints",
                hint="set checkpoint.enabled=true, or train.on_nonfinite=skip",
            )
        return TrainingError(
            f"{fault}; train.on_nonfinite=rollback, but the run has no checkpoint yet to roll "
            "back to",
            hint="set checkpoint.every_steps=N so that one is written early, "
            "or train.on_nonfinite=skip",
        )

    def keep(self, metrics: TaskMetrics) -> None:
        """Remember the epoch's running metrics after a good step (``skip`` only).

        A skipped step has already added its NaN loss to them; :meth:`restore` takes them
        back to this snapshot (``TaskMetrics.snapshot``: no fold, no copy to the host).
        """
        self._kept = metrics.snapshot()

    def restore(self, metrics: TaskMetrics) -> None:
        """Put back what :meth:`keep` remembered."""
        if self._kept is not None:
            metrics.restore(self._kept)

    # --- fp16 overflow ---------------------------------------------------------------------

    def stepped(self) -> None:
        """A step updated the parameters: an overflow streak, if any, is over."""
        self._streak = 0
        self._settled = True

    def overflowed(self, step: int, *, scale_before: float, scale_after: float) -> str | None:
        """Count an fp16 overflow step (the scaler skipped it and lowered the scale).

        Returns:
            A warning when a burst reaches ``burst_steps`` steps after training got going
            (before the first good step, overflows are the scaler finding its scale).

        Raises:
            TrainingError: The scale fell below ``min_loss_scale``.
        """
        if self._streak == 0:
            self._streak_first, self._streak_scale = step, scale_before
        self._streak += 1
        self._epoch["overflow"] += 1
        if scale_after < self.min_loss_scale:
            raise TrainingError(
                f"fp16 loss scale collapsed from {self._streak_scale:g} to {scale_after:g} after "
                f"{self._streak} consecutive overflow steps (steps {self._streak_first}-{step}); "
                "the model produces inf/NaN gradients even at tiny scales",
                hint="lower optim.lr, use train.precision=bf16, or check the data for NaN/inf "
                f"values (train.min_loss_scale={self.min_loss_scale:g} sets this limit)",
            )
        if self._settled and self._streak == self.burst_steps:
            return (
                f"warning: fp16 overflow in {self._streak} steps in a row (steps "
                f"{self._streak_first}-{step}), each skipped; loss scale now {scale_after:g}. "
                "The gradients are near fp16's range: if it goes on the scale collapses "
                f"(an error below train.min_loss_scale={self.min_loss_scale:g}); "
                "train.precision=bf16 avoids it"
            )
        return None

    # --- records ---------------------------------------------------------------------------

    def epoch_record(self, *, loss_scale: float | None) -> dict[str, float]:
        """The epoch's counts for its record (the keys that apply to this run); resets them.

        Args:
            loss_scale: The fp16 loss scale now; None when not scaling.
        """
        record: dict[str, float] = {}
        if loss_scale is not None:
            record["numerics/overflow_steps"] = self._epoch["overflow"]
            record["numerics/loss_scale"] = loss_scale
        if self.policy == "skip":
            record["numerics/skipped_steps"] = self._epoch["skipped"]
        if self.policy == "rollback":
            record["numerics/rollbacks"] = self._epoch["rollbacks"]
        self._epoch = dict.fromkeys(self._epoch, 0)
        return record


def _listing(steps: list[int], shown: int = 10) -> str:
    text = ", ".join(str(step) for step in steps[:shown])
    return text + (f" and {len(steps) - shown} more" if len(steps) > shown else "")


# --- the loop's side -------------------------------------------------------------------


class RollbackNeeded(Exception):
    """Raised by ``train_step`` on a fault under ``on_nonfinite=rollback``."""

    def __init__(self, fault: Fault, batches: int) -> None:
        super().__init__(str(fault))
        self.fault = fault
        self.batches = batches  # the bad step's micro-batches, consumed with it


def check_step(
    loop: Loop,
    step_loss: torch.Tensor,
    metrics: TaskMetrics,
    *,
    batches: int,
    checked: tuple[bool, bool] | None = None,
) -> Literal["ok", "overflow", "skipped"]:
    """Whether the step may update the parameters; applies ``train.on_nonfinite`` if not.

    ``halt`` raises a TrainingError naming the step and the first parameter with a
    non-finite gradient; ``rollback`` raises RollbackNeeded (``train_epoch`` restores
    the checkpoint); ``skip`` counts the step and returns "skipped". ``checked`` is the
    check's ``(loss finite, gradients finite)`` when the caller already made it.
    """
    check = loop.finite_check()
    # The CPU–GPU sync point, unless the caller's check was it.
    loss_ok, grads_ok = check(step_loss) if checked is None else checked
    guard = loop.numerics
    if not grads_ok:
        check.reset()
    if loss_ok and grads_ok:
        if guard.policy == "skip":
            guard.keep(metrics)  # what a later skipped step goes back to
        return "ok"
    if loss_ok and loop.precision.scaling:
        if guard.policy == "skip":
            guard.keep(metrics)
        return "overflow"  # fp16: expected now and then; the scaler skips the step
    state = loop.state
    fault = describe_fault(
        loop.model, step_loss, step=state.step + 1, epoch=state.epoch_number, loss_ok=loss_ok
    )
    if guard.policy == "halt":
        raise guard.halt(fault)
    if guard.policy == "rollback":
        raise RollbackNeeded(fault, batches)
    loop.progress.message(guard.count_skip(fault))
    guard.restore(metrics)  # the skipped step's loss and predictions do not count
    loop.sink.log(
        {
            "epoch": state.epoch_number,
            "step": fault.step,
            "numerics/skipped": fault.what,
            "numerics/skipped_steps": len(guard.skipped_steps),
        }
    )
    return "skipped"


def overflow_step(loop: Loop) -> None:
    """fp16: the scaler skips ``optimizer.step`` and halves the scale; count it, watch it.

    Reading the scale twice is a sync, on overflow steps only.
    """
    scale_before = loop.precision.loss_scale() or 0.0
    loop.precision.step(loop.optimizer)
    warning = loop.numerics.overflowed(
        loop.state.step + 1,
        scale_before=scale_before,
        scale_after=loop.precision.loss_scale() or 0.0,
    )
    if warning is not None:
        loop.progress.message(warning)


def roll_back(loop: Loop, fault: Fault, *, batches: int) -> None:
    """Restore the newest valid checkpoint and set up the epoch to go on after ``batches``.

    The batches since the checkpoint are not replayed: their order is fixed by the seed,
    so replaying them would replay the fault. When the checkpoint is from an earlier
    epoch (the newer ones were damaged), the run goes on from the checkpoint's position.
    """
    guard = loop.numerics
    guard.count_rollback(fault)  # raises once the limit is used up
    restored = loop.rollback() if loop.rollback is not None else None
    if restored is None:
        raise guard.no_checkpoint(fault, enabled=loop.rollback is not None)
    loop.optimizer.zero_grad(set_to_none=True)
    loop.history = restored.history
    progress = restored.in_epoch
    if loop.state.epoch_number == fault.epoch:
        progress = dict(progress) if progress else _fresh_progress(loop)
        progress["batches"] = batches
        loader = loop.train_loader
        loader.load_state_dict(loader.state_dict(batches_consumed=batches))
        where = f"going on with batch {batches + 1} of epoch {fault.epoch}"
    else:
        where = f"training again from epoch {loop.state.epoch_number}"
    loop.resume_in_epoch = progress
    loop.sink.log(
        {
            "epoch": fault.epoch,
            "step": fault.step,
            "numerics/rolled_back_to_step": loop.state.step,
            "numerics/rollbacks": len(guard.rollback_steps),
        }
    )
    loop.progress.message(
        f"warning: {fault}; rolled back to {restored.checkpoint.name} (step "
        f"{loop.state.step}), {where} ({len(guard.rollback_steps)} of at most "
        f"{guard.max_rollbacks} rollbacks, train.max_rollbacks)"
    )


def _fresh_progress(loop: Loop) -> dict[str, Any]:
    """The in-epoch progress of an epoch that has not started (an epoch-end checkpoint)."""
    ignored = loop.ignore_index if loop.normalize == "tokens" else None
    return {
        "batches": 0,
        "steps": 0,
        "metrics": TaskMetrics(loop.task, ignore_index=ignored).state_dict(),
        "grad_norm_sum": torch.zeros(()),
        "grad_norm_count": 0,
    }
