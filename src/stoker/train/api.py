"""``stoker.fit``: the Python entry point, with the config's options as keyword arguments."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from stoker.config import config_from_options
from stoker.data.sources import ArrayDataset, split_dataset
from stoker.errors import ConfigError
from stoker.train.pipeline import UserComponents
from stoker.train.session import FitResult, train_run

DataLike = Dataset | IterableDataset | Sequence[torch.Tensor | np.ndarray]


def fit(
    model: nn.Module,
    train_data: DataLike,
    val_data: DataLike | None = None,
    *,
    resume: str | Path | None = None,
    progress: Literal["auto", "rich", "plain", "quiet"] = "auto",
    allow_data_change: bool = False,
    allow_config_change: bool = False,
    callbacks: Sequence[object] = (),
    **options: Any,
) -> FitResult:
    """Train ``model`` on ``train_data``, validating on ``val_data`` after each epoch.

    Every run-config option can be given by its own name — ``epochs``, ``batch_size``,
    ``lr``, ``precision``, ``grad_accum_steps``, ``clip_grad_norm``, ``run_dir``,
    ``seed`` … (the full list is ``stoker.config.FLAT_OPTIONS``); ``optimizer``,
    ``schedule`` and ``loss`` take the config's names. ``loss`` and ``collate_fn``
    may also be callables; ``optimizer`` a ``torch.optim.Optimizer`` over the model's
    parameters or a factory ``params -> Optimizer``; ``schedule`` an LR scheduler over
    that optimizer or a factory ``optimizer -> scheduler``; ``step_fn`` and ``eval_fn``
    functions ``(model, batch) -> loss or {"loss": ..., "other": ...}`` that replace
    the forward and the loss (see docs/own-code.md).

    Args:
        model: Any ``torch.nn.Module``.
        train_data: A Dataset (map-style or iterable), or a tuple of arrays/tensors
            ``(features, labels, ...)`` sharing their first dimension.
        val_data: The same for validation; or pass ``val_fraction=0.2`` to split train.
        resume: A run dir to continue from its last checkpoint.
        progress: How to show progress; ``quiet`` prints nothing.
        allow_data_change: With ``resume``, continue even if the training data changed.
        allow_config_change: With ``resume``, continue even if the batch size, workers,
            seed or another setting the exact resume depends on changed.
        callbacks: Objects with any of the hooks of ``stoker.Callback``, called in order.

    Returns:
        The final metrics, the per-epoch history, the run dir and the trained model.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"fit: model must be a torch.nn.Module, got {type(model).__name__}")
    loss_fn = _pop_callable(options, "loss")
    collate_fn = _pop_callable(options, "collate_fn")
    step_fn = _pop_callable(options, "step_fn")
    eval_fn = _pop_callable(options, "eval_fn")
    optimizer = _pop_callable(options, "optimizer", torch.optim.Optimizer)
    scheduler = _pop_callable(options, "schedule", torch.optim.lr_scheduler.LRScheduler)
    if loss_fn is not None and "loss" not in options:
        options["loss"] = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    config = config_from_options(options)
    train = _as_dataset(train_data, "train_data")
    val = _as_dataset(val_data, "val_data") if val_data is not None else None
    if val is None and config.data.val_fraction is not None:
        train, val = split_dataset(train, config.data.val_fraction, seed=config.data.split_seed)
    user = UserComponents(
        model=model,
        train_data=train,
        val_data=val,
        loss_fn=loss_fn,
        collate_fn=collate_fn,
        optimizer=optimizer,
        scheduler=scheduler,
        callbacks=tuple(callbacks),
        step_fn=step_fn,
        eval_fn=eval_fn,
    )
    return train_run(
        config,
        user=user,
        resume=resume,
        progress=progress,
        allow_data_change=allow_data_change,
        allow_config_change=allow_config_change,
    )


def _pop_callable(options: dict[str, Any], key: str, *kinds: type) -> Any:
    """Take ``key`` out of the options when it holds a callable (or one of ``kinds``)."""
    value = options.get(key)
    if value is not None and (callable(value) or isinstance(value, kinds)):
        del options[key]
        return value
    return None


def _as_dataset(data: DataLike, argument: str) -> Dataset:
    if isinstance(data, (Dataset, IterableDataset)):
        return data
    if (
        isinstance(data, (tuple, list))
        and data
        and all(isinstance(item, (torch.Tensor, np.ndarray)) for item in data)
    ):
        return ArrayDataset(*data)
    raise ConfigError(
        f"fit: {argument} must be a torch Dataset or a tuple of arrays, got {type(data).__name__}",
        hint=f"pass {argument}=(features, labels) or a torch.utils.data.Dataset",
    )
