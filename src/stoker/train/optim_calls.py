"""The loop's two optimizer calls, ``step`` and ``zero_grad``, through PyTorch's public API.

``step`` is ``optimizer.step()`` — fused or foreach Adam as its public flag says, with its
hooks, profiler labels and any LR-scheduler wrapper — or, when the loss is scaled (fp16),
``GradScaler.step(optimizer)``. Nothing here calls a kernel or reads an attribute that
``torch.optim`` keeps to itself.

``zero_grad`` sets every gradient to None, which is what
``optimizer.zero_grad(set_to_none=True)`` does; it does it in a plain loop when the
optimizer's class keeps ``torch.optim.Optimizer.zero_grad``. That method opens a profiler
range and walks the same groups, about 12 µs on the seed MLP's four parameters (5% of its
step) for an assignment per parameter; the one thing lost is the ``Optimizer.zero_grad``
label in a profiler trace. An optimizer with a ``zero_grad`` of its own (a class or an
instance override present when the loop starts) gets it called.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from functools import partial

import torch

from stoker.train.precision import Precision

#: ``_STEP(optimizer)`` is ``optimizer.step()``, looked up at each call, so a wrapper that
#: an LR scheduler (or the user) installs later is called too.
_STEP = operator.methodcaller("step")


class OptimizerCalls:
    """``step()`` and ``zero_grad()`` of one optimizer, as the training loop makes them."""

    def __init__(self, optimizer: torch.optim.Optimizer, precision: Precision) -> None:
        self.optimizer = optimizer
        # Decided once: an override of zero_grad set on the instance later is not seen.
        self._own_zero = type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad or (
            "zero_grad" in vars(optimizer)
        )
        #: One update of the parameters.
        self.step: Callable[[], object]
        if precision.scaling:
            self.step = partial(precision.step, optimizer)
        else:
            self.step = partial(_STEP, optimizer)

    def zero_grad(self) -> None:
        """Every gradient to None (``optimizer.zero_grad(set_to_none=True)``)."""
        optimizer = self.optimizer
        if self._own_zero:
            optimizer.zero_grad(set_to_none=True)
            return
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                parameter.grad = None
