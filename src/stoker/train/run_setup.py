"""Pieces of a run built from its config, before the loop starts: the run's length, the
user's step functions, the monitored metric, device prefetch, torchrun's restarts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from stoker import components
from stoker.config import RunConfig
from stoker.distributed.runtime import Distributed
from stoker.errors import ConfigError
from stoker.train.metric_set import Metrics, monitor_mode
from stoker.train.monitor import Monitor
from stoker.train.pipeline import UserComponents


def prefetch_enabled(setting: bool | str, device: torch.device) -> bool:
    """Whether batches are copied to the device ahead of the step: ``auto`` means on CUDA."""
    if setting == "auto":
        return device.type == "cuda"
    if setting and device.type != "cuda":
        raise ConfigError(
            f"train.prefetch=true needs a CUDA device; this run trains on {device}",
            hint="set train.prefetch=auto (on with CUDA, off elsewhere)",
        )
    return bool(setting)


def total_steps(config: RunConfig, loader: Any) -> int:
    """Optimizer steps in the whole run, the horizon of decaying schedules."""
    try:
        per_epoch = math.ceil(len(loader) / config.train.grad_accum_steps)
    except TypeError:
        decays = config.schedule.name not in ("constant", "step")
        if decays and config.train.max_steps is None and config.schedule.total_steps is None:
            raise ConfigError(
                f"schedule.name={config.schedule.name} needs to know the run's length, "
                "but the training data has no len()",
                hint="set train.max_steps or schedule.total_steps",
            ) from None
        return config.train.max_steps or config.schedule.total_steps or 1
    total = per_epoch * config.train.epochs
    return min(total, config.train.max_steps) if config.train.max_steps else total


def step_functions(config: RunConfig, user: UserComponents) -> tuple[Any, Any]:
    """The user's step_fn and eval_fn: objects given to ``fit`` win over the config's."""
    step_fn, eval_fn = components.build_step_fns(config)
    step_fn, eval_fn = user.step_fn or step_fn, user.eval_fn or eval_fn
    if eval_fn is not None and step_fn is None:
        raise ConfigError(
            "train.eval_fn is set but train.step_fn is not",
            hint="set train.step_fn too (eval_fn replaces validation only)",
        )
    if step_fn is not None and config.loss.normalize == "tokens":
        raise ConfigError(
            "loss.normalize=tokens counts the targets' real tokens, which a step_fn's "
            "batch does not name",
            hint="set loss.normalize=samples; average over tokens inside the step_fn",
        )
    if step_fn is not None and (config.train.metrics or user.metrics):
        # They score (outputs, targets), which a step_fn's batch does not name: they
        # would be dropped without a word.
        raise ConfigError(
            "train.metrics cannot be computed with a step_fn: they take the model's outputs "
            "and the targets, and a step_fn returns its own figures",
            hint="return them from the step_fn (and eval_fn) as entries of its dict, "
            "{'loss': loss, 'f1': ...}, logged as train/f1 and val/f1; and leave "
            "train.metrics (fit's metrics=) empty",
        )
    return step_fn, eval_fn


def build_monitor(config: RunConfig, *, has_val: bool, metrics: Metrics | None = None) -> Monitor:
    """The metric that picks the best checkpoint and drives early stopping."""
    metric = config.train.monitor or ("val/loss" if has_val else "train/loss")
    if metric.startswith("val/") and not has_val:
        raise ConfigError(
            f"train.monitor={metric} but the run has no validation data",
            hint="set data.val or data.val_fraction, or train.monitor=train/loss",
        )
    mode = monitor_mode(metric, config.train.monitor_mode, metrics or Metrics())
    stopping = config.train.early_stopping
    return Monitor(
        metric=metric,
        mode=mode,
        patience=stopping.patience if stopping else None,
        min_delta=stopping.min_delta if stopping else 0.0,
    )


def elastic_resume(
    config: RunConfig, dist: Distributed, resume: str | Path | None
) -> str | Path | None:
    """After torchrun restarts the group, every rank resumes the run dir it was writing."""
    if resume is not None or dist.info.restart_count == 0:
        return resume
    if config.tracking.run_dir is None:
        raise ConfigError(
            f"torchrun restarted this group (restart {dist.info.restart_count}) but the run "
            "has no fixed run dir to resume from",
            hint="pass --run-dir DIR (stoker train --nproc sets one for you)",
        )
    run_dir = Path(config.tracking.run_dir)
    # A group that failed before rank 0 wrote config.yaml starts the run afresh.
    return run_dir if (run_dir / "config.yaml").is_file() else None
