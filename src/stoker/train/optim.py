"""Optimizers and learning-rate schedules (warmup + constant/cosine/step/one-cycle)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from stoker.config import OptimConfig, ScheduleConfig


def build_optimizer(
    model: nn.Module, config: OptimConfig, *, device: torch.device
) -> torch.optim.Optimizer:
    """The optimizer over the model's trainable parameters.

    ``fused: auto`` picks PyTorch's fused kernel for Adam/AdamW where the device has
    one (CUDA, and CPU since PyTorch 2.4): the same update with fewer kernel launches.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    options: dict[str, Any] = {"lr": config.lr}
    if config.weight_decay is not None:
        options["weight_decay"] = config.weight_decay
    if config.name == "sgd":
        return torch.optim.SGD(
            params, momentum=config.momentum, nesterov=config.nesterov, **options
        )
    fused = config.fused
    if fused == "auto":
        fused = device.type in ("cuda", "cpu") and all(p.is_floating_point() for p in params)
    cls = torch.optim.AdamW if config.name == "adamw" else torch.optim.Adam
    return cls(params, betas=config.betas, eps=config.eps, fused=bool(fused), **options)


def lr_multiplier(
    config: ScheduleConfig, *, total_steps: int, base_lr: float
) -> Callable[[int], float]:
    """The factor on the base lr after ``step`` optimizer steps (LambdaLR's contract).

    Warmup rises linearly over ``warmup_steps`` (the first step uses ``1/warmup_steps``
    of the lr); the named schedule then runs over the remaining steps, or over
    ``total_steps`` when the config gives it. Cosine matches ``CosineAnnealingLR``.
    """
    warmup = config.warmup_steps
    min_factor = config.min_lr / base_lr
    horizon = config.total_steps or max(1, total_steps - warmup)

    def main(t: int) -> float:
        if config.name == "constant":
            return 1.0
        if config.name == "step":
            return config.gamma ** (t // config.step_size)
        if config.name == "cosine":
            return _cosine(min(t, horizon) / horizon, end=min_factor)
        # one-cycle: cosine up from 1/div_factor to 1, then down to 1/(div*final_div).
        start = 1.0 / config.div_factor
        end = start / config.final_div_factor
        rise = max(1.0, config.pct_start * horizon - 1)
        if t <= rise:
            return _cosine(t / rise, start=start, end=1.0)
        fall = max(1.0, horizon - 1 - rise)
        return _cosine(min(1.0, (t - rise) / fall), start=1.0, end=end)

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return main(step - warmup)

    return multiplier


def _cosine(progress: float, *, start: float = 1.0, end: float = 0.0) -> float:
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: ScheduleConfig, *, total_steps: int
) -> LambdaLR:
    """A LambdaLR stepped once per optimizer step; its state is just the step count."""
    if config.name == "constant" and config.warmup_steps == 0:
        return ConstantLR(optimizer)
    base_lr = optimizer.param_groups[0]["lr"]
    return LambdaLR(optimizer, lr_multiplier(config, total_steps=total_steps, base_lr=base_lr))


def _constant(step: int) -> float:
    return 1.0


class ConstantLR(LambdaLR):
    """The schedule of a constant lr: ``step`` only counts the steps.

    LambdaLR's ``step`` calls the multiplier and sets every group's lr again — to the same
    value — which costs about 2 µs, near 1% of a small model's step, for nothing. The
    state is LambdaLR's (the multiplier is 1), so checkpoints load into either.

    Nor does it wrap ``optimizer.step``: LRScheduler wraps it in a Python function on
    every step so that ``LRScheduler.step`` can warn when called before any
    ``optimizer.step``, a warning this schedule, which never changes the lr, does not give.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        own_step = "step" in vars(optimizer)  # e.g. another scheduler's wrapper: kept
        super().__init__(optimizer, _constant)  # its first step is this class's: it counts
        if not own_step and getattr(optimizer.step, "_wrapped_by_lr_sched", False):
            del optimizer.step  # the class's step again
        self._last_lr = [group["lr"] for group in optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        self._step_count += 1
        self.last_epoch += 1
