"""Running training and validation metrics, kept on the device until they are read."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist

from stoker.data.samplers import rank_and_world_size

Task = Literal["classification", "regression"]

#: On the CPU, how many steps' outputs and losses are held before they are folded into
#: the sums, and the most output elements held. A fold is ~10 tensor ops whatever the
#: number of steps (a tensor op costs microseconds on a small model), so holding a few
#: hundred small batches takes the metrics' cost per step from ~25 µs to ~1 µs.
_HOLD_STEPS = 256
_HOLD_ELEMENTS = 1 << 18

#: One held batch: detached outputs, targets, detached mean loss, count.
_Held = tuple[torch.Tensor, Any, torch.Tensor, int]


class TaskMetrics:
    """Sums of loss, correct predictions and errors over an epoch.

    Updates stay on the device (no ``.item()`` of a device tensor), so recording a step
    costs no CPU–GPU synchronization; ``compute`` reads everything at once.

    On the CPU, ``update`` only keeps references to the batch (no tensor op): the held
    batches are folded into the sums a few hundred at a time, with one concatenation
    and one argmax for all of them (``_fold``). Elsewhere — and for outputs too large to
    hold — each batch is folded as it comes (a device keeps running ahead of the host, so
    its ops are cheap to launch, and holding outputs could pin memory or CUDA-graph
    buffers that the next step overwrites). Either way the sums are the same: loss ×
    count, correct predictions, absolute and squared errors; only the rounding of the
    float sums differs (a batched loss sum is exact in float64, then rounded once).
    """

    def __init__(self, task: Task | None, *, ignore_index: int | None = None) -> None:
        """``task`` None infers it from the first batch's targets.

        With ``ignore_index`` (token-level losses), ``count`` passed to ``update`` is the
        number of real tokens and accuracy skips targets equal to it.
        """
        self.task = task
        self.ignore_index = ignore_index
        # Ordinary tensors even when made under inference_mode: held batches may be
        # folded into them in place after it (in ``compute``).
        with torch.inference_mode(False):
            self._loss_sum = torch.zeros(())
            self._correct = torch.zeros((), dtype=torch.long)
            self._abs_err = torch.zeros(())
            self._sq_err = torch.zeros(())
        self.samples = 0
        self._has_accuracy = False
        self._held: list[_Held] = []
        # 0 until the first batch is folded, which picks how many later ones are held.
        self._hold = 0

    def update(self, outputs: torch.Tensor, targets: Any, loss: torch.Tensor, count: int) -> None:
        """Add one batch: the mean loss over ``count`` samples and the predictions.

        Detached references only: the batch's tensors must not be changed in place
        afterwards (the loop's never are: each step has new ones).
        """
        self.samples += count
        held = self._held
        # A loss the caller already detached is held as it is (detach makes a new tensor).
        held.append(
            (outputs.detach(), targets, loss.detach() if loss.requires_grad else loss, count)
        )
        if len(held) >= self._hold:
            self._fold()

    def _fold(self) -> None:
        """Add the held batches to the sums (the first fold also infers the task)."""
        if not self._held:
            return
        held = self._held.copy()
        self._held.clear()  # in place: a restored state must not see these again
        outputs, targets, loss, _ = held[0]
        if self.task is None:
            # A custom loss: integer labels mean classes, float targets mean regression.
            floating = isinstance(targets, torch.Tensor) and targets.is_floating_point()
            self.task = "regression" if floating else "classification"
        if self._loss_sum.device != loss.device:
            self._move(loss.device)
        if not self._hold:
            self._hold = _hold_steps(outputs, loss)
        self._add_losses(held)
        joined = _joined(held)
        if joined is None:  # shapes differ from batch to batch: one at a time
            for outputs, targets, _, _ in held:
                self._add_predictions(outputs, targets)
        else:
            self._add_predictions(*joined)

    def _add_losses(self, held: list[_Held]) -> None:
        if len(held) == 1:
            _, _, loss, count = held[0]
            self._loss_sum.add_(loss, alpha=count)
            return
        # Several are held only on the CPU, where reading a scalar is no sync, and is
        # quicker than stacking them; fsum is exact, so the order does not matter.
        self._loss_sum.add_(math.fsum(loss.item() * count for _, _, loss, count in held))

    def _add_predictions(self, outputs: torch.Tensor, targets: Any) -> None:
        if not isinstance(targets, torch.Tensor):
            return
        if self.task == "classification":
            hits = _hits(outputs, targets, self.ignore_index)
            if hits is not None:
                self._correct.add_(hits.sum())
                self._has_accuracy = True
        elif self.task == "regression" and outputs.shape == targets.shape:
            error = outputs.float() - targets.float()
            self._abs_err.add_(error.abs().sum())
            self._sq_err.add_(error.square().sum())

    def _move(self, device: torch.device) -> None:
        with torch.inference_mode(False):  # as in __init__
            self._loss_sum = self._loss_sum.to(device)
            self._correct = self._correct.to(device)
            self._abs_err = self._abs_err.to(device)
            self._sq_err = self._sq_err.to(device)

    def compute(self, prefix: str) -> dict[str, float]:
        """The epoch's metrics under ``prefix/`` (a CPU–GPU sync point).

        In a distributed run the sums are reduced over the ranks first, so every rank
        reports the whole epoch's metrics (each rank must call this at the same point).
        """
        loss_sum, correct, abs_err, sq_err, n, has_accuracy = self._totals()
        if n == 0:
            return {}
        values = {f"{prefix}/loss": loss_sum / n}
        if has_accuracy:
            values[f"{prefix}/accuracy"] = correct / n
        if self.task == "regression" and prefix == "val":
            values[f"{prefix}/mse"] = sq_err / n
            values[f"{prefix}/mae"] = abs_err / n
        return values

    def _totals(self) -> tuple[float, int, float, float, int, bool]:
        """The sums, over every rank in a distributed run (one all-reduce, every rank calls).

        In float64 (exact counts up to 2**53), on the CPU for MPS, which has no float64.
        """
        self._fold()
        device = self._loss_sum.device
        if device.type == "mps":
            device = torch.device("cpu")
        counts = torch.tensor(
            [float(self.samples), float(self._has_accuracy)], dtype=torch.float64, device=device
        )
        # Each to float64 on its own: stacking first would round the int64 count to float32.
        parts = [self._loss_sum, self._correct, self._abs_err, self._sq_err]
        sums = torch.cat([torch.stack([part.to(device, torch.float64) for part in parts]), counts])
        if rank_and_world_size()[1] > 1:
            dist.all_reduce(sums)
        loss_sum, correct, abs_err, sq_err, n, has_accuracy = sums.tolist()
        return loss_sum, round(correct), abs_err, sq_err, round(n), has_accuracy > 0

    def loss_sum(self) -> torch.Tensor:
        self._fold()
        return self._loss_sum

    def state_dict(self) -> dict:
        """The running sums, so a run resumed mid-epoch reports the whole epoch."""
        self._fold()
        return {
            "task": self.task,
            "loss_sum": self._loss_sum.detach().cpu(),
            "correct": self._correct.detach().cpu(),
            "abs_err": self._abs_err.detach().cpu(),
            "sq_err": self._sq_err.detach().cpu(),
            "samples": self.samples,
            "has_accuracy": self._has_accuracy,
        }

    def snapshot(self) -> tuple[Any, ...]:
        """The running state as it is now, to go back to with :meth:`restore`.

        For a step that may yet be taken back (``on_nonfinite=skip``): unlike
        ``state_dict`` it folds nothing and copies nothing to the host — four device
        clones, and the held batches by reference (they are never changed in place).
        """
        sums = (self._loss_sum, self._correct, self._abs_err, self._sq_err)
        held = (list(self._held), self._hold)
        return self.task, tuple(t.clone() for t in sums), self.samples, self._has_accuracy, held

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        """Go back to a :meth:`snapshot` (which stays valid for another restore)."""
        self.task, sums, self.samples, self._has_accuracy, (held, self._hold) = snapshot
        self._loss_sum, self._correct, self._abs_err, self._sq_err = (t.clone() for t in sums)
        self._held[:] = held  # in place, as _fold relies on

    def load_state_dict(self, state: dict) -> None:
        """Replace the sums; batches held since the last fold are dropped with them."""
        self._held.clear()
        self.task = state["task"]
        self._loss_sum, self._correct = state["loss_sum"], state["correct"]
        self._abs_err, self._sq_err = state["abs_err"], state["sq_err"]
        self.samples, self._has_accuracy = state["samples"], state["has_accuracy"]


def _hold_steps(outputs: torch.Tensor, loss: torch.Tensor) -> int:
    """How many batches to hold before folding them: 1 (none) off the CPU."""
    if loss.device.type != "cpu" or outputs.device.type != "cpu":
        return 1
    return max(1, min(_HOLD_STEPS, _HOLD_ELEMENTS // max(outputs.numel(), 1)))


def _joined(held: list[_Held]) -> tuple[torch.Tensor, Any] | None:
    """The held outputs and targets, each concatenated along the batch; None when their
    shapes beyond the batch differ (or they cannot be joined)."""
    if len(held) == 1:
        return held[0][0], held[0][1]
    try:
        outputs = torch.cat([outputs for outputs, *_ in held])
        targets = torch.cat([targets for _, targets, *_ in held])
    except (RuntimeError, TypeError):
        return None
    return outputs, targets


def _hits(
    outputs: torch.Tensor, targets: torch.Tensor, ignore_index: int | None = None
) -> torch.Tensor | None:
    """Which predictions are right: argmax for class logits, sign for binary logits.

    Class logits are ``[N, C]`` or, per token, ``[N, C, T]`` (CrossEntropyLoss's layout).
    None when the outputs are neither (no accuracy for this batch).
    """
    if outputs.ndim == targets.ndim + 1 and not targets.is_floating_point():
        hits = outputs.argmax(dim=1).eq(targets)
        if ignore_index is not None:
            hits &= targets.ne(ignore_index)
        return hits
    binary = outputs.ndim == 1 or (outputs.ndim > 1 and outputs.shape[-1] == 1)
    if binary and outputs.shape == targets.shape:
        # One binary logit per sample against 0/1 targets (BCEWithLogits).
        return outputs.gt(0).eq(targets.gt(0.5))
    return None


@dataclass
class StepWindow:
    """Sums since the last step-level record, kept on the device (no per-step sync).

    The loss of every step that was not skipped is kept, and summed when the window is
    recorded (one stack and sum, not an add per step). The gradient norm is measured
    on the window's first step that updates the parameters (and on every step when
    clipping by norm needs it anyway): measuring it is a pass over every gradient, too
    dear to pay on each step for a figure recorded every ``log_every_steps``.
    """

    grad_norm: torch.Tensor
    #: The step losses (0-d float32 tensors) of the steps that were not skipped.
    step_losses: list[torch.Tensor] = field(default_factory=list)
    steps: int = 0
    norms: int = 0  # steps whose norm is in `grad_norm`
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, device: torch.device) -> StepWindow:
        return cls(torch.zeros((), device=device))

    @property
    def losses(self) -> int:
        """Steps whose loss is in the window (skipped steps are not)."""
        return len(self.step_losses)

    @property
    def loss(self) -> torch.Tensor:
        """The sum of the window's step losses, on the device."""
        if not self.step_losses:
            return torch.zeros((), device=self.grad_norm.device)
        return torch.stack(self.step_losses).sum()
