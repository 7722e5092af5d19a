"""Running training and validation metrics, kept on the device until they are read."""

from __future__ import annotations

from typing import Literal

import torch

Task = Literal["classification", "regression"]


class TaskMetrics:
    """Sums of loss, correct predictions and errors over an epoch.

    Updates stay on the device (no ``.item()``), so recording a step costs no
    CPU–GPU synchronization; ``compute`` reads everything at once.
    """

    def __init__(self, task: Task | None, *, ignore_index: int | None = None) -> None:
        """``task`` None infers it from the first batch's targets.

        With ``ignore_index`` (token-level losses), ``count`` passed to ``update`` is the
        number of real tokens and accuracy skips targets equal to it.
        """
        self.task = task
        self.ignore_index = ignore_index
        self._loss_sum = torch.zeros(())
        self._correct = torch.zeros((), dtype=torch.long)
        self._abs_err = torch.zeros(())
        self._sq_err = torch.zeros(())
        self.samples = 0
        self._has_accuracy = False

    def update(
        self, outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, count: int
    ) -> None:
        """Add one batch: the mean loss over ``count`` samples and the predictions."""
        if self.task is None:
            # A custom loss: integer labels mean classes, float targets mean regression.
            self.task = "regression" if targets.is_floating_point() else "classification"
        device = loss.device
        if self._loss_sum.device != device:
            self._move(device)
        self._loss_sum += loss.detach().float() * count
        self.samples += count
        if self.task == "classification":
            correct = _correct_predictions(outputs, targets, self.ignore_index)
            if correct is not None:
                self._correct += correct
                self._has_accuracy = True
        elif self.task == "regression" and outputs.shape == targets.shape:
            error = outputs.detach().float() - targets.float()
            self._abs_err += error.abs().sum()
            self._sq_err += error.square().sum()

    def _move(self, device: torch.device) -> None:
        self._loss_sum = self._loss_sum.to(device)
        self._correct = self._correct.to(device)
        self._abs_err = self._abs_err.to(device)
        self._sq_err = self._sq_err.to(device)

    def compute(self, prefix: str) -> dict[str, float]:
        """The epoch's metrics under ``prefix/`` (a CPU–GPU sync point)."""
        if self.samples == 0:
            return {}
        n = self.samples
        values = {f"{prefix}/loss": self._loss_sum.item() / n}
        if self._has_accuracy:
            values[f"{prefix}/accuracy"] = self._correct.item() / n
        if self.task == "regression" and prefix == "val":
            values[f"{prefix}/mse"] = self._sq_err.item() / n
            values[f"{prefix}/mae"] = self._abs_err.item() / n
        return values

    def loss_sum(self) -> torch.Tensor:
        return self._loss_sum

    def state_dict(self) -> dict:
        """The running sums, so a run resumed mid-epoch reports the whole epoch."""
        return {
            "task": self.task,
            "loss_sum": self._loss_sum.detach().cpu(),
            "correct": self._correct.detach().cpu(),
            "abs_err": self._abs_err.detach().cpu(),
            "sq_err": self._sq_err.detach().cpu(),
            "samples": self.samples,
            "has_accuracy": self._has_accuracy,
        }

    def load_state_dict(self, state: dict) -> None:
        self.task = state["task"]
        self._loss_sum, self._correct = state["loss_sum"], state["correct"]
        self._abs_err, self._sq_err = state["abs_err"], state["sq_err"]
        self.samples, self._has_accuracy = state["samples"], state["has_accuracy"]


def _correct_predictions(
    outputs: torch.Tensor, targets: torch.Tensor, ignore_index: int | None = None
) -> torch.Tensor | None:
    """Correct predictions in a batch: argmax for class logits, sign for binary logits.

    Class logits are ``[N, C]`` or, per token, ``[N, C, T]`` (CrossEntropyLoss's layout).
    """
    outputs = outputs.detach()
    if outputs.ndim == targets.ndim + 1 and not targets.is_floating_point():
        hits = outputs.argmax(dim=1) == targets
        if ignore_index is not None:
            hits &= targets != ignore_index
        return hits.sum()
    if outputs.shape == targets.shape and (outputs.ndim == 1 or outputs.shape[-1] == 1):
        # One binary logit per sample against 0/1 targets (BCEWithLogits).
        return ((outputs > 0) == (targets > 0.5)).sum()
    return None
