"""Gradient clipping by norm or value, the pre-clip total norm, and naming a non-finite gradient."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from stoker.checkpoint.export import unwrap_model


class GradClipper:
    """Clips by norm or by value, and measures the total gradient norm when it is needed.

    The norm is a device tensor (no sync), taken *before* clipping: the figure that tells
    whether clipping is doing anything. Clipping by norm needs it every step; otherwise
    the loop asks for it only on the steps it records (measuring costs a pass over every
    gradient, which on a small model is a tenth of the step).
    """

    def __init__(self, *, max_norm: float | None = None, max_value: float | None = None) -> None:
        self.max_norm = max_norm
        self.max_value = max_value
        self.clipped_steps = torch.zeros((), dtype=torch.long)
        #: Whether the last ``clip_`` clipped (a device tensor; False when not clipping).
        self.last_clipped: torch.Tensor | bool = False

    @property
    def clipping(self) -> bool:
        """Whether this clipper changes gradients at all."""
        return self.max_norm is not None or self.max_value is not None

    def measure(self, grads: list[torch.Tensor], *, wanted: bool) -> torch.Tensor | None:
        """The pre-clip total L2 norm when ``wanted`` or when clipping by norm needs it."""
        if not grads:
            return torch.zeros(()) if wanted else None
        if wanted or self.max_norm is not None:
            return torch.nn.utils.get_total_norm(grads, foreach=True)
        return None

    def apply_(self, parameters: list[nn.Parameter], norm: torch.Tensor | None) -> None:
        """Clip the gradients of ``parameters`` in place (``norm`` from :meth:`measure`).

        Clipping by norm with the norm measured beforehand is what ``clip_grad_norm_`` does
        inside, so the result is bitwise the same.
        """
        with_grads = [p for p in parameters if p.grad is not None]
        if not with_grads:
            return
        if self.max_norm is not None:
            assert norm is not None, "measure() gives the norm when clipping by norm"
            torch.nn.utils.clip_grads_with_norm_(with_grads, self.max_norm, norm, foreach=True)
            self._count(norm > self.max_norm)
        elif self.max_value is not None:
            grads = [p.grad for p in with_grads]
            exceeded = torch.stack([g.abs().max() for g in grads]).max() > self.max_value
            self._count(exceeded)
            torch.nn.utils.clip_grad_value_(with_grads, self.max_value, foreach=True)

    def clip_(self, parameters: Iterable[nn.Parameter]) -> torch.Tensor:
        """Measure and clip in one call; returns the pre-clip total L2 norm."""
        with_grads = [p for p in parameters if p.grad is not None]
        norm = self.measure([p.grad for p in with_grads], wanted=True)
        assert norm is not None
        self.apply_(with_grads, norm)
        return norm

    def _count(self, clipped: torch.Tensor) -> None:
        self.last_clipped = clipped
        if self.clipped_steps.device != clipped.device:
            self.clipped_steps = self.clipped_steps.to(clipped.device)
        self.clipped_steps += clipped.long()


def first_nonfinite_grad(model: nn.Module) -> str | None:
    """The name of the first parameter (in registration order) with an inf/NaN gradient.

    Names are the model's own (no ``_orig_mod.`` or ``module.`` from torch.compile or
    DDP); under FSDP each rank looks at its own shard of every gradient.
    """
    for name, parameter in unwrap_model(model).named_parameters():
        grad = parameter.grad
        if grad is None:
            continue
        values = grad.coalesce().values() if grad.is_sparse else local_tensor(grad)
        if not torch.isfinite(values).all():
            return name
    return None


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) tensor; any other tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def whole_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into a plain tensor (a collective: every rank must call it)."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor
