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
``_fused_adamw_``) — from lists built once, so the parameters and the optimizer state
come out bitwise those of ``optimizer.step()`` (a test checks it step by step). It
calls ``optimizer.step()`` itself whenever it cannot vouch for that: an optimizer
other than fused Adam/AdamW, a hyperparameter it does not pass through (a tensor lr,
``capturable``, ``differentiable``), step hooks, the profiler running (so traces keep
PyTorch's labels), a step wrapped by anything but an LR scheduler's counter, a
parameter without a gradient this step, loss scaling (fp16, where GradScaler drives the
step), and the very first step (which creates the state). The lists are rebuilt when
``load_state_dict`` or ``add_param_group`` changes what they point at. A PyTorch whose
kernel takes other arguments (a ``TypeError`` before it runs) gets ``optimizer.step()``
from then on.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from stoker.train.precision import Precision

_ADAM_CLASSES = (torch.optim.Adam, torch.optim.AdamW)
_PROFILING = torch.autograd._profiler_enabled  # C function: is a profiler recording?
_NEVER = object()


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
        self._kernel = _fused_kernel(optimizer)
        self._direct_zero = type(
            optimizer
        ).zero_grad is torch.optim.Optimizer.zero_grad and "zero_grad" not in vars(optimizer)
        # The step as the optimizer holds it: its class's, or an LR scheduler's wrapper,
        # which only notes that a step was made (the first step, always a real one, does
        # that). Any other wrapper must run, so the direct path is never taken.
        self._own_step = _counting_wrapper(vars(optimizer).get("step"))
        self._groups: list[_Group] | None = None  # built after the first real step
        # What the lists were built from: load_state_dict replaces the groups' list and
        # the state; add_param_group lengthens the list.
        self._built_from: tuple[list[Any], Any, int] = ([], None, -1)
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self._params_from = _shape_of(optimizer)
        self.direct_steps = 0  # how many steps took the direct path (for tests, docs)
        #: One update of the parameters.
        self.step: Callable[[], object]
        if precision.scaling:
            self.step = partial(precision.step, optimizer)
        elif self._kernel is None:
            self.step = optimizer.step
        else:
            self.step = self._direct_step

    def _direct_step(self) -> None:
        """The fused kernel straight, or ``optimizer.step()`` when that is not provably
        the same."""
        optimizer = self.optimizer
        if _changed(optimizer, self._built_from):
            optimizer.step()  # the first step makes the state the lists point into
            self._groups = _direct_groups(optimizer)  # None: this optimizer never goes direct
            self._built_from = _shape_of(optimizer)
            return
        groups = self._groups
        wrapper = vars(optimizer).get("step")
        if wrapper is not self._own_step:
            self._own_step = _counting_wrapper(wrapper)  # a scheduler built since: fine
            optimizer.step()
            return
        if groups is None or _PROFILING() or _has_step_hooks(optimizer):
            optimizer.step()
            return
        gradients = [[p.grad for p in group.params] for group in groups]
        if any(g is None for grads in gradients for g in grads):
            optimizer.step()  # a parameter without a gradient is left alone: Adam's rule
            return
        kernel = self._kernel
        previous = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # the kernel writes into leaves that require grad
        try:
            for group, grads in zip(groups, gradients, strict=True):
                group.run(kernel, grads)
        except TypeError:
            # Another PyTorch's signature: refused before any group was updated (the
            # first group's call fails the same way), its step counts taken back.
            self.step = self.optimizer.step
            optimizer.step()
            return
        finally:
            torch._C._set_grad_enabled(previous)
        self.direct_steps += 1

    def zero_grad(self) -> None:
        """Every gradient to None (``optimizer.zero_grad(set_to_none=True)``)."""
        optimizer = self.optimizer
        if not self._direct_zero or _PROFILING() or _changed(optimizer, self._params_from):
            self._params = [p for group in optimizer.param_groups for p in group["params"]]
            self._params_from = _shape_of(optimizer)
            optimizer.zero_grad(set_to_none=True)
            return
        for parameter in self._params:
            parameter.grad = None


class _Group:
    """One param group's tensors and settings, as ``_fused_adam`` passes them."""

    def __init__(self, group: dict[str, Any], state: dict[Any, Any]) -> None:
        self.settings = group
        self.params: list[torch.Tensor] = list(group["params"])
        states = [state[p] for p in self.params]
        self.exp_avgs = [s["exp_avg"] for s in states]
        self.exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        self.max_exp_avg_sqs = [s["max_exp_avg_sq"] for s in states] if group["amsgrad"] else []
        self.steps = [s["step"] for s in states]

    def run(self, kernel: Callable[..., None], grads: list[torch.Tensor]) -> None:
        """``_fused_adam``'s two calls for one device and dtype: count the step, update."""
        group = self.settings
        beta1, beta2 = group["betas"]
        torch._foreach_add_(self.steps, 1)
        try:
            kernel(
                self.params,
                grads,
                self.exp_avgs,
                self.exp_avg_sqs,
                self.max_exp_avg_sqs,
                self.steps,
                amsgrad=group["amsgrad"],
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                grad_scale=None,
                found_inf=None,
            )
        except TypeError:  # refused its arguments: it updated nothing
            torch._foreach_sub_(self.steps, 1)
            raise


def _fused_kernel(optimizer: torch.optim.Optimizer) -> Callable[..., None] | None:
    """The kernel ``optimizer.step()`` would end in, if it is one this module can call."""
    if type(optimizer) not in _ADAM_CLASSES or not optimizer.param_groups:
        return None
    decoupled = {bool(g.get("decoupled_weight_decay")) for g in optimizer.param_groups}
    if type(optimizer) is torch.optim.AdamW:
        decoupled = {True}  # AdamW is Adam with decoupled weight decay, whatever the key
    if len(decoupled) != 1:
        return None
    name = "_fused_adamw_" if decoupled.pop() else "_fused_adam_"
    return getattr(torch, name, None)


def _direct_groups(optimizer: torch.optim.Optimizer) -> list[_Group] | None:
    """The groups' tensor lists, or None when a group cannot take the direct call."""
    groups = []
    for group in optimizer.param_groups:
        if not _plain_fused(group):
            return None
        params = group["params"]
        if not params or any(p not in optimizer.state or not optimizer.state[p] for p in params):
            return None  # a parameter that has not been stepped yet has no state
        if len({(p.device, p.dtype) for p in params}) != 1 or any(_sharded(p) for p in params):
            return None  # _fused_adam regroups such lists; a DTensor dispatches its own way
        groups.append(_Group(group, optimizer.state))
    return groups


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


def _counting_wrapper(step: object) -> object:
    """``step`` when it is None or an LR scheduler's counting wrapper, else a marker that
    matches nothing (so that wrapper always runs)."""
    if step is None or getattr(step, "_wrapped_by_lr_sched", False):
        return step
    return _NEVER


def _has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    return bool(
        optimizer._optimizer_step_pre_hooks
        or optimizer._optimizer_step_post_hooks
        or torch_optimizer._global_optimizer_pre_hooks
        or torch_optimizer._global_optimizer_post_hooks
    )


def _shape_of(optimizer: torch.optim.Optimizer) -> tuple[list[Any], Any, int]:
    """What the cached lists depend on, compared by identity (and the groups' count)."""
    return optimizer.param_groups, optimizer.state, len(optimizer.param_groups)


def _changed(optimizer: torch.optim.Optimizer, shape: tuple[list[Any], Any, int]) -> bool:
    groups, state, count = shape
    return (
        optimizer.param_groups is not groups or optimizer.state is not state or len(groups) != count
    )


def _sharded(parameter: torch.Tensor) -> bool:
    return callable(getattr(parameter, "to_local", None))
