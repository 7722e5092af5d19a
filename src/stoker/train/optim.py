"""Optimizers and learning-rate schedules (warmup + constant/cosine/step/one-cycle),
built-in or the user's own (an object, a factory, or an import path in the config)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from stoker.config import OPTIMIZERS, SCHEDULES, OptimConfig, ScheduleConfig
from stoker.errors import ConfigError

#: What ``stoker.fit(optimizer=...)`` takes besides a name: an optimizer, or a factory
#: ``params -> Optimizer``; and ``schedule=``: a scheduler, or ``optimizer -> scheduler``.
UserOptimizer = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer]
UserScheduler = Any


def build_optimizer(
    model: nn.Module,
    config: OptimConfig,
    *,
    device: torch.device,
    user: UserOptimizer | None = None,
) -> torch.optim.Optimizer:
    """The optimizer over the model's trainable parameters.

    ``user`` (an optimizer, or a factory called with the parameters) wins over the
    config; an import path in ``optim.name`` is called with the parameters, ``lr``,
    ``weight_decay`` (when set) and ``optim.args``. ``fused: auto`` picks PyTorch's
    fused kernel for the built-in Adam/AdamW where the device has one (CUDA, and CPU
    since PyTorch 2.4): the same update with fewer kernel launches.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if user is not None:
        return _users_optimizer(user, model, params)
    if config.name not in OPTIMIZERS:
        return _imported_optimizer(config, params)
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
    optimizer: torch.optim.Optimizer,
    config: ScheduleConfig,
    *,
    total_steps: int,
    user: UserScheduler | None = None,
) -> Any:
    """The schedule, stepped once per optimizer step.

    A built-in is a LambdaLR whose state is just the step count. ``user`` (a scheduler
    over ``optimizer``, or a factory called with it) wins over the config; an import
    path in ``schedule.name`` is called with the optimizer, ``schedule.args`` and
    ``total_steps`` (the run's optimizer steps) when it takes that argument.
    """
    if user is not None or config.name not in SCHEDULES:
        return _users_scheduler(user, optimizer, config, total_steps=total_steps)
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
        """Count the step; the lr never changes, so nothing is computed."""
        self._step_count += 1
        self.last_epoch += 1


# --- the user's own -------------------------------------------------------------------


def _users_optimizer(
    user: UserOptimizer, model: nn.Module, params: list[nn.Parameter]
) -> torch.optim.Optimizer:
    if isinstance(user, torch.optim.Optimizer):
        optimizer = user
    elif callable(user):
        optimizer = user(params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(
                f"fit: optimizer= factory {_name(user)} returned a {type(optimizer).__name__}, "
                "not a torch.optim.Optimizer",
                hint="pass optimizer=lambda params: MyOptimizer(params, lr=...)",
            )
    else:
        raise ConfigError(
            f"fit: optimizer= got a {type(user).__name__}",
            hint="pass a name (adamw, adam, sgd), a torch.optim.Optimizer, or a factory "
            "params -> Optimizer",
        )
    own = {id(p) for p in model.parameters()}
    foreign = sum(id(p) not in own for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ConfigError(
            f"fit: the optimizer updates {foreign} tensor(s) that are not the model's "
            "parameters (built over another model or a copy, or before FSDP sharded it)",
            hint="build it over model.parameters() of the model given to fit, or pass a "
            "factory: optimizer=lambda params: MyOptimizer(params, lr=...)",
        )
    return optimizer


def _imported_optimizer(config: OptimConfig, params: list[nn.Parameter]) -> torch.optim.Optimizer:
    from stoker.components import accepts, resolve_callable  # components imports the config

    _refuse_builtin_fields(config, OptimConfig, ("momentum", "nesterov", "betas", "eps", "fused"))
    cls = resolve_callable(config.name, field="optim.name", builtins={})
    args = dict(config.args)
    defaults = {"lr": config.lr, "weight_decay": config.weight_decay}
    for key, value in defaults.items():
        if value is not None and key not in args and accepts(cls, key):
            args[key] = value
    try:
        optimizer = cls(params, **args)
    except TypeError as error:
        raise ConfigError(
            f"optim: {config.name}(params, **{args}) failed: {error}",
            hint="check the keys under optim.args",
        ) from None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"optim.name: {config.name} made a {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    return optimizer


def _users_scheduler(
    user: UserScheduler | None,
    optimizer: torch.optim.Optimizer,
    config: ScheduleConfig,
    *,
    total_steps: int,
) -> Any:
    field = "fit: schedule="
    if user is None:
        from stoker.components import accepts, resolve_callable

        _refuse_builtin_fields(
            config,
            ScheduleConfig,
            ("warmup_steps", "total_steps", "min_lr", "step_size", "gamma", "pct_start",
             "div_factor", "final_div_factor"),
        )  # fmt: skip
        field = "schedule.name:"
        factory = resolve_callable(config.name, field="schedule.name", builtins={})
        args = dict(config.args)
        if "total_steps" not in args and accepts(factory, "total_steps"):
            args["total_steps"] = total_steps
        try:
            scheduler = factory(optimizer, **args)
        except TypeError as error:
            raise ConfigError(
                f"schedule: {config.name}(optimizer, **{args}) failed: {error}",
                hint="check the keys under schedule.args",
            ) from None
    elif isinstance(user, torch.optim.lr_scheduler.LRScheduler):
        scheduler = user
    elif callable(user):
        scheduler = user(optimizer)
    else:
        raise ConfigError(
            f"fit: schedule= got a {type(user).__name__}",
            hint="pass a name (constant, cosine, step, onecycle), an LR scheduler, or a "
            "factory optimizer -> scheduler",
        )
    missing = [m for m in ("step", "state_dict", "load_state_dict", "get_last_lr")
               if not callable(getattr(scheduler, m, None))]  # fmt: skip
    if missing:
        raise ConfigError(
            f"{field} {type(scheduler).__name__} is no LR scheduler (it has no "
            f"{', '.join(missing)})",
            hint="return a torch.optim.lr_scheduler scheduler (LambdaLR, OneCycleLR, ...)",
        )
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ConfigError(
            f"{field} the scheduler was built over another optimizer than the run's",
            hint="pass a factory: schedule=lambda optimizer: MyScheduler(optimizer, ...)",
        )
    return scheduler


def _refuse_builtin_fields(config: Any, section: type, names: tuple[str, ...]) -> None:
    """Built-in-only settings changed beside an import path would be silently ignored."""
    prefix = "optim" if section is OptimConfig else "schedule"
    changed = [n for n in names if getattr(config, n) != section.model_fields[n].default]
    if changed:
        keys = ", ".join(f"{prefix}.{n}" for n in changed)
        raise ConfigError(
            f"{keys}: set for the built-in {prefix} kinds only, but {prefix}.name is {config.name}",
            hint=f"pass them to {config.name} under {prefix}.args instead",
        )


def _name(value: Any) -> str:
    return getattr(value, "__qualname__", type(value).__name__)
