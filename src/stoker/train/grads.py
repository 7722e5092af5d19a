"""Gradient clipping by norm or value, the pre-clip total norm, and finding and naming a
non-finite gradient."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

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


class FiniteCheck:
    """Finds inf/NaN in a loss and in every gradient of ``parameters`` without a sync.

    ``torch._amp_foreach_non_finite_check_and_unscale_`` (what ``GradScaler.unscale_`` runs)
    checks a whole list of tensors in one fused kernel and multiplies them by an inverse
    scale; with a scale of exactly 1 the gradients keep every bit. It costs about a
    microsecond on the CPU for a small model, where ``get_total_norm`` costs twenty. The
    flags stay on the device, and are only set, never cleared, by the check: a step that
    finds them raised calls :meth:`reset` (no zeroing kernel on every step).

    On the CPU with one group of parameters (the usual case) the flag is read through a
    numpy view of its memory, and the loss with one ``item``: no stacking, no dispatch
    but the kernel's and that read.
    """

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        *,
        agree: Callable[[bool, bool], tuple[bool, bool]] | None = None,
    ) -> None:
        """``agree`` combines the verdicts of all ranks (distributed), so every rank
        handles a fault the same way: a NaN loss on one rank, or a bad gradient shard
        under FSDP, is a fault on all of them."""
        self._agree = agree
        groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for parameter in parameters:
            if parameter.requires_grad:
                groups.setdefault((parameter.device, parameter.dtype), []).append(parameter)
        flags = {device: torch.zeros((), device=device) for device, _ in groups}
        ones = {device: torch.ones((), device=device) for device in flags}
        # Whether a group holds sharded (DTensor) parameters, whose gradients are checked
        # as this rank's shard; a plain group skips looking for ``to_local`` on each one.
        self._groups = [
            (group, flags[d], ones[d], any(_sharded(p) for p in group))
            for (d, _), group in groups.items()
        ]
        self._flags = list(flags.values())
        self._host = all(flag.device.type == "cpu" for flag in self._flags)
        # The one plain group on the CPU, if that is all there is: the fast path.
        single = self._host and len(self._groups) == 1 and not self._groups[0][3]
        self._single = self._groups[0] if single else None
        if self._single is not None:
            self._view = self._single[1].numpy()  # shares the flag's memory
        fused = getattr(torch, "_amp_foreach_non_finite_check_and_unscale_", None)
        self._fused: Callable[..., None] = fused if fused is not None else _check_each

    def __call__(self, loss: torch.Tensor) -> tuple[bool, bool]:
        """``(loss finite, every gradient finite)``: the step's one CPU–GPU sync point."""
        if self._single is not None:
            group, flag, one, _ = self._single
            self._run([p.grad for p in group if p.grad is not None], flag, one)
            verdict = math.isfinite(loss.item()), not self._view.item()
        else:
            for group, flag, one, sharded in self._groups:
                grads = [p.grad for p in group if p.grad is not None]
                self._run([local_tensor(g) for g in grads] if sharded else grads, flag, one)
            if self._host:
                # On the CPU two scalar reads cost less than stacking them.
                raised = any(flag.item() for flag in self._flags)
                verdict = math.isfinite(loss.item()), not raised
            else:
                # On an accelerator the values travel together, in one transfer.
                together = [loss.detach().float().reshape(())]
                together += [flag.to(loss.device) for flag in self._flags]
                first, *rest = torch.stack(together).tolist()
                verdict = math.isfinite(first), not any(rest)
        return self._agree(*verdict) if self._agree is not None else verdict

    def _run(self, grads: list[torch.Tensor], flag: torch.Tensor, one: torch.Tensor) -> None:
        """Raise ``flag`` if any of ``grads`` is not finite (and leave their bits alone)."""
        if not grads:
            return
        try:
            self._fused(grads, flag, one)
        except (NotImplementedError, RuntimeError):
            # Sparse gradients (nn.Embedding(sparse=True)): one check per tensor from now.
            self._fused = _check_each
            _check_each(grads, flag, one)

    def reset(self) -> None:
        """Lower the flags after a step that raised them."""
        for flag in self._flags:
            flag.zero_()


def _sharded(parameter: nn.Parameter) -> bool:
    """Whether ``parameter`` is a DTensor (FSDP2): its gradient is one too."""
    return callable(getattr(parameter, "to_local", None))


def _check_each(grads: list[torch.Tensor], found: torch.Tensor, one: torch.Tensor) -> None:
    """The check one tensor at a time (sparse gradients, or a PyTorch without the fused
    kernel): still no sync."""
    for grad in grads:
        values = grad.coalesce().values() if grad.is_sparse else grad
        found.add_((~torch.isfinite(values)).any().to(found.dtype))
