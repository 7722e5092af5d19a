"""The loop's two optimizer calls, ``step`` and ``zero_grad``, made without the Python
that ``torch.optim`` wraps around them when the answer is provably the same.

On a small model that Python costs more than the work. ``Adam(fused=True).step()``
opens a profiler range, walks the step hooks, switches grad mode (importing
``torch._dynamo`` to do it), rebuilds its per-parameter state lists from the state dict
and regroups every tensor by device and dtype — all before the one fused kernel that
does the update; ``zero_grad`` opens a profiler range too, to set each gradient to None.
On the seed MLP (four parameters) the two cost 80–90 µs more than the kernel call
alone inside a 262 µs training step (``benchmarks/trainer.py``), about 45 µs in a tight
``timeit`` loop.

:class:`OptimizerCalls` makes the same kernel calls on the same tensors with the same
arguments — ``torch._foreach_add_`` on the step counts, then ``torch._fused_adam_`` (or
``_fused_adamw_``) — from lists it builds in a few comprehensions, so the parameters
and the optimizer state come out bitwise those of ``optimizer.step()`` (tests check it
step by step); a parameter without a gradient is left alone, as Adam leaves it. It
calls ``optimizer.step()`` itself whenever it cannot vouch for that: an optimizer other
than fused Adam/AdamW, a setting it does not pass through (a tensor lr, ``capturable``,
``differentiable``), step hooks, the profiler recording (so traces keep PyTorch's
labels), a step wrapped by anything but an LR scheduler's counter of the class's own,
loss scaling (fp16, where GradScaler drives the step), and a parameter with no state
yet (the first step creates it). It caches nothing: each step reads the groups, their
settings and the state afresh, as ``optimizer.step()`` does, so clearing the state,
replacing a group or editing its parameter list in place is followed at once. A
PyTorch whose kernel refuses these arguments (a ``TypeError`` before it runs) gets
``optimizer.step()`` from then on.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer

from stoker.train.precision import Precision

_ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_PROFILING = torch.autograd._profiler_enabled  # C function: is a profiler recording?
#: ``_STEP(optimizer)`` is ``optimizer.step()``, looked up at each call (a wrapper that
#: an LR scheduler installs later is called too), with no Python frame of its own.
_STEP = operator.methodcaller("step")


class OptimizerCalls:
    """``step()`` and ``zero_grad()`` of one optimizer, as the training loop makes them.

    ``step`` goes through ``precision.step(optimizer)`` when the loss is scaled (fp16),
    else straight to the fused kernel when it can (see the module docstring), else to
    ``optimizer.step()``. ``zero_grad`` sets every gradient to None, as
    ``optimizer.zero_grad(set_to_none=True)`` does, unless the optimizer's class has a
    ``zero_grad`` of its own or a profiler is recording.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        self.optimizer = optimizer
        self._direct_zero = type(
            optimizer
        ).zero_grad is torch.optim.Optimizer.zero_grad and "zero_grad" not in vars(optimizer)
        self.direct_steps = 0  # how many steps took the direct path (for tests, docs)
        #: One update of the parameters.
        self.step: Callable[[], object]
        if precision.scaling:
            self.step = partial(precision.step, optimizer)
        elif type(optimizer) in _ADAM_CLASSES:
            self.step = self._direct_step
        else:
            self.step = partial(_STEP, optimizer)

    def _direct_step(self) -> None:
        """The fused kernel straight, or ``optimizer.step()`` when that is not provably
        the same."""
        optimizer = self.optimizer
        calls = None
        if not _PROFILING() and not _has_step_hooks(optimizer) and _own_step(optimizer):
            calls = _kernel_calls(optimizer)
        if calls is None:
            optimizer.step()
            return
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # the kernel writes into leaves that require grad
        try:
            for index, (kernel, arguments, options) in enumerate(calls):
                _run(kernel, arguments, options, first=index == 0)
        except _Refused:
            self.step = partial(_STEP, optimizer)  # another PyTorch's signature: for good
            optimizer.step()
            return
        finally:
            torch._C._set_grad_enabled(previous)
        self.direct_steps += 1

    def zero_grad(self) -> None:
        """Every gradient to None (``optimizer.zero_grad(set_to_none=True)``)."""
        optimizer = self.optimizer
        if not self._direct_zero or _PROFILING():
            optimizer.zero_grad(set_to_none=True)
            return
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                parameter.grad = None


class _Refused(Exception):
    """The first kernel call refused its arguments; nothing was updated."""


#: One kernel call: (kernel, its positional tensor lists, its keyword options).
_Call = tuple[Callable[..., None], tuple[list[torch.Tensor], ...], dict[str, Any]]


def _kernel_calls(optimizer: torch.optim.Optimizer) -> list[_Call] | None:
    """What ``optimizer.step()`` would call for each group, read afresh from the groups
    and the state (as ``Adam._init_group`` does); None when a group takes another path."""
    state, calls = optimizer.state, []
    adamw = type(optimizer) is torch.optim.AdamW
    for group in optimizer.param_groups:
        if not _plain_fused(group):
            return None
        params = [p for p in group["params"] if p.grad is not None]  # Adam skips the rest
        if not params:
            continue
        states = [state.get(p) for p in params]
        if not all(states):
            return None  # a parameter's first step: optimizer.step() creates its state
        if len({(type(p), p.device, p.dtype) for p in params}) != 1 or type(params[0]) not in (
            nn.Parameter,
            torch.Tensor,
        ):
            return None  # _fused_adam would regroup the lists; a DTensor dispatches its own way
        decoupled = adamw or group.get("decoupled_weight_decay", False)
        beta1, beta2 = group["betas"]
        calls.append(
            (
                torch._fused_adamw_ if decoupled else torch._fused_adam_,
                (
                    params,
                    [p.grad for p in params],
                    [s["exp_avg"] for s in states],  # type: ignore[index]
                    [s["exp_avg_sq"] for s in states],  # type: ignore[index]
                    [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else [],  # type: ignore[index]
                    [s["step"] for s in states],  # type: ignore[index]
                ),
                {
                    "amsgrad": group["amsgrad"],
                    "lr": group["lr"],
                    "beta1": beta1,
                    "beta2": beta2,
                    "weight_decay": group["weight_decay"],
                    "eps": group["eps"],
                    "maximize": group["maximize"],
                    "grad_scale": None,
                    "found_inf": None,
                },
            )
        )
    return calls


def _run(
    kernel: Callable[..., None],
    arguments: tuple[list[torch.Tensor], ...],
    options: dict[str, Any],
    *,
    first: bool,
) -> None:
    """``_fused_adam``'s two calls for one group: count the step, then update."""
    steps = arguments[-1]
    torch._foreach_add_(steps, 1)
    try:
        kernel(*arguments, **options)
    except TypeError:  # refused its arguments: it updated nothing
        torch._foreach_sub_(steps, 1)
        if first:  # no group was updated: optimizer.step() can take the whole step
            raise _Refused from None
        raise


def _plain_fused(group: dict[str, Any]) -> bool:
    """Whether ``group`` is a fused group whose settings pass straight to the kernel."""
    betas = group.get("betas", ())
    return (
        bool(group.get("fused"))
        and not group.get("capturable")
        and not group.get("differentiable")
        and not group.get("foreach")
        and isinstance(group.get("lr"), float | int)
        and len(betas) == 2
        and all(isinstance(beta, float | int) for beta in betas)
    )


def _own_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` is its class's, or an LR scheduler's counting wrapper
    of exactly that (which only notes that a step was made: the first step, always a
    real one, does that). Any other wrapper must run."""
    step = vars(optimizer).get("step")
    if step is None:
        return True
    return bool(getattr(step, "_wrapped_by_lr_sched", False)) and (
        getattr(step, "__wrapped__", None) is type(optimizer).step
    )


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )
