"""Gradient health: the pre-clip norm, clipping by norm or value, non-finite detection."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class GradClipper:
    """Measures the total gradient norm every step and clips by norm or by value.

    The norm is returned as a device tensor (no sync); it is the norm *before*
    clipping, the figure that tells whether clipping is doing anything.
    """

    def __init__(self, *, max_norm: float | None = None, max_value: float | None = None) -> None:
        self.max_norm = max_norm
        self.max_value = max_value
        self.clipped_steps = torch.zeros((), dtype=torch.long)
        #: Whether the last ``clip_`` clipped (a device tensor; False when not clipping).
        self.last_clipped: torch.Tensor | bool = False

    def clip_(self, parameters: Iterable[nn.Parameter]) -> torch.Tensor:
        """Clip the gradients in place; returns the pre-clip total L2 norm."""
        with_grads = [p for p in parameters if p.grad is not None]
        if not with_grads:
            return torch.zeros(())
        grads = [p.grad for p in with_grads]
        if self.max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(with_grads, self.max_norm, foreach=True)
            self._count(norm > self.max_norm)
            return norm
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if self.max_value is not None:
            exceeded = torch.stack([g.abs().max() for g in grads]).max() > self.max_value
            self._count(exceeded)
            torch.nn.utils.clip_grad_value_(with_grads, self.max_value, foreach=True)
        return norm

    def _count(self, clipped: torch.Tensor) -> None:
        self.last_clipped = clipped
        if self.clipped_steps.device != clipped.device:
            self.clipped_steps = self.clipped_steps.to(clipped.device)
        self.clipped_steps += clipped.long()


def first_nonfinite_grad(model: nn.Module) -> str | None:
    """The name of the first parameter (in registration order) with an inf/NaN gradient."""
    for name, parameter in model.named_parameters():
        if parameter.grad is not None and not torch.isfinite(parameter.grad).all():
            return name
    return None
