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
        #: Whether this clipper changes gradients at all (read on every step: an attribute).
        self.clipping = max_norm is not None or max_value is not None
        self.clipped_steps = torch.zeros((), dtype=torch.long)
        #: Whether the last ``clip_`` clipped (a device tensor; False when not clipping).
        self.last_clipped: torch.Tensor | bool = False

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
    """Finds inf/NaN in a loss and in every gradient of ``parameters``: one read per step.

    The gradients are reduced to one number: a sum (or a sum of squares) that is finite
    proves every element finite, since an inf or NaN anywhere reaches it (inf plus -inf
    is NaN). One that is not finite may still be finite values that overflowed, so only
    then is every element looked at (``torch.isfinite``), on this rare path. On the CPU
    a small model's gradients are joined first (``torch.cat``, one kernel for the
    reduction instead of one per tensor) and, in float32 or float64, reduced by
    ``torch.dot`` of the joined vector with itself, which dispatches in two thirds of a
    ``sum``'s instructions; past a million elements each tensor is summed where it
    lies, so no copy of the gradients is made. numpy is no cheaper: its reductions cost
    as much to call as PyTorch's (about 10,000 instructions), and its BLAS threads spin
    on a busy machine. The loss is read to the host here; ``loss_value`` keeps it, so
    that recording it costs nothing more.

    On an accelerator the total L2 norm (``torch.nn.utils.get_total_norm``, one fused
    kernel per device and dtype) travels to the host together with the loss, in one
    transfer: the step's one CPU–GPU sync point. Sparse gradients are checked by their
    values; sharded (DTensor) ones by this rank's shard.
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
        #: The loss the last call read, a host number (the loop records it: no more reads).
        self.loss_value = math.nan
        #: The total L2 norm of the gradients the last call looked at, when it measured
        #: it on the way (squared and summed on the CPU in float32/64; on an accelerator
        #: the norm it reads anyway) and it was finite; else None. Equal to
        #: ``get_total_norm`` up to float rounding: the loop records it instead of
        #: measuring again. Sharded gradients give no norm (a shard's is not the whole).
        self.grad_norm: float | None = None
        self._parameters = [p for p in parameters if p.requires_grad]
        self._host = all(p.device.type == "cpu" for p in self._parameters)
        self._sharded = any(_sharded(p) for p in self._parameters)
        # One dtype, few elements, on the CPU: the gradients are joined for one sum.
        self._join = (
            self._host
            and not self._sharded
            and len({p.dtype for p in self._parameters}) == 1
            and sum(p.numel() for p in self._parameters) <= _JOIN_NUMEL
        )
        # The joined gradients are reduced with a dot product with themselves (the
        # squared norm: inf/NaN reach it as they reach a sum), a BLAS call that costs
        # two thirds of a sum's dispatch; other dtypes are summed.
        self._dot = self._join and self._parameters[0].dtype in (torch.float32, torch.float64)

    def __call__(self, loss: torch.Tensor) -> tuple[bool, bool]:
        """``(loss finite, every gradient finite)``: the step's one CPU–GPU sync point."""
        if self._join:
            try:
                # One pass over the parameters; a 1-d gradient (a bias) joins as it is,
                # and ravel flattens the others (a view, with no shape to parse).
                flat = [
                    g if g.ndim == 1 else g.ravel()
                    for p in self._parameters
                    if (g := p.grad) is not None
                ]
                if flat:
                    joined = torch.cat(flat)
                    total = torch.dot(joined, joined) if self._dot else joined.sum()
            except RuntimeError:  # a sparse gradient: summed on its own from now on
                self._join = False
            else:
                reduced = total.item() if flat else 0.0
                grads_ok = math.isfinite(reduced) or _each_finite(flat)
                finite_norm = self._dot and math.isfinite(reduced)
                self.grad_norm = math.sqrt(reduced) if finite_norm else None
                self.loss_value = value = loss.item()
                verdict = math.isfinite(value), grads_ok
                return self._agree(*verdict) if self._agree is not None else verdict
        self.grad_norm = None
        grads = [p.grad for p in self._parameters if p.grad is not None]
        if self._sharded or any(g.is_sparse for g in grads):
            grads = [_values(g) for g in grads]
        if self._host:
            self.loss_value = value = loss.item()
            verdict = math.isfinite(value), _host_finite(grads)
        else:
            together = [loss.detach().float().reshape(())]
            if grads:
                together.append(
                    torch.nn.utils.get_total_norm(grads, foreach=True).float().to(loss.device)
                )
            first, *rest = torch.stack(together).tolist()
            grads_ok = all(math.isfinite(value) for value in rest) or _each_finite(grads)
            if rest and math.isfinite(rest[0]) and not self._sharded:
                self.grad_norm = rest[0]
            self.loss_value = first
            verdict = math.isfinite(first), grads_ok
        return self._agree(*verdict) if self._agree is not None else verdict

    def reset(self) -> None:
        """Nothing to lower: the check keeps no flag from one step to the next."""


#: Up to this many gradient elements on the CPU, the sum is taken over one joined copy.
_JOIN_NUMEL = 1 << 20


def _values(grad: torch.Tensor) -> torch.Tensor:
    """What is checked of a gradient: a sparse one's values, a DTensor's local shard."""
    if grad.is_sparse:
        return grad.coalesce().values()
    return local_tensor(grad)


def _host_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every CPU gradient is finite (see :class:`FiniteCheck`)."""
    if not grads:
        return True
    total = torch.stack([g.sum(dtype=torch.float32) for g in grads]).sum()
    return math.isfinite(total.item()) or _each_finite(grads)


def _sharded(parameter: nn.Parameter) -> bool:
    """Whether ``parameter`` is a DTensor (FSDP2): its gradient is one too."""
    return callable(getattr(parameter, "to_local", None))


def _each_finite(grads: list[torch.Tensor]) -> bool:
    """Whether every element of every gradient is finite, one tensor at a time."""
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
