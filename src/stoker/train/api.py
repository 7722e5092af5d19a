"""``stoker.fit``: the Python entry point, with the config's options as keyword arguments."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Unpack

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from stoker.config import DataConfig, config_from_options
from stoker.data.sources import ArrayDataset, split_train_val_test
from stoker.errors import ConfigError
from stoker.train.fit_options import FitOptions
from stoker.train.metric_set import split_fit_metrics
from stoker.train.pipeline import UserComponents
from stoker.train.session import FitResult, train_run

logger = logging.getLogger("stoker")

DataLike = Dataset[Any] | IterableDataset[Any] | Sequence[torch.Tensor | np.ndarray]


def fit(
    model: nn.Module,
    train_data: DataLike,
    val_data: DataLike | None = None,
    *,
    test_data: DataLike | None = None,
    resume: str | Path | None = None,
    progress: Literal["auto", "rich", "plain", "quiet"] = "auto",
    allow_data_change: bool = False,
    allow_config_change: bool = False,
    callbacks: Sequence[object] = (),
    **options: Unpack[FitOptions],
) -> FitResult:
    """Train ``model`` on ``train_data``, validating on ``val_data`` after each epoch.

    Every run-config option can be given by its own name — ``epochs``, ``batch_size``,
    ``lr``, ``precision``, ``grad_accum_steps``, ``clip_grad_norm``, ``run_dir``,
    ``seed`` … (every option with its type and config key: ``stoker.FitOptions``, which
    an editor completes and a type checker checks); ``optimizer``,
    ``schedule`` and ``loss`` take the config's names. ``loss`` and ``collate_fn``
    may also be callables; ``optimizer`` a ``torch.optim.Optimizer`` over the model's
    parameters or a factory ``params -> Optimizer``; ``schedule`` an LR scheduler over
    that optimizer or a factory ``optimizer -> scheduler``; ``step_fn`` and ``eval_fn``
    functions ``(model, batch) -> loss or {"loss": ..., "other": ...}`` that replace
    the forward and the loss (see docs/own-code.md). ``metrics`` takes built-in names
    (``["f1", "top5_accuracy"]``), functions ``(outputs, targets) -> number`` and
    torchmetrics objects, in a list or a ``{key: metric}`` dict.

    Args:
        model: Any ``torch.nn.Module``.
        train_data: A Dataset (map-style or iterable), or a tuple of arrays/tensors
            ``(features, labels, ...)`` sharing their first dimension.
        val_data: The same for validation; or pass ``val_fraction=0.2`` to split train.
        test_data: The same, evaluated once at the end with the best (or last) weights
            (``test_checkpoint``); or pass ``test_fraction=0.1`` to split train.
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
    raw: dict[str, Any] = dict(options)  # popped and rewritten below
    loss_fn = _pop_callable(raw, "loss")
    collate_fn = _pop_callable(raw, "collate_fn")
    step_fn = _pop_callable(raw, "step_fn")
    eval_fn = _pop_callable(raw, "eval_fn")
    optimizer = _pop_callable(raw, "optimizer", torch.optim.Optimizer)
    scheduler = _pop_callable(raw, "schedule", torch.optim.lr_scheduler.LRScheduler)
    if loss_fn is not None and "loss" not in raw:
        raw["loss"] = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    raw["metrics"], metric_objects = split_fit_metrics(raw.pop("metrics", None))
    config = config_from_options(raw)
    dtype = _float_dtype(model)
    train = _as_dataset(train_data, "train_data", dtype=dtype)
    val = _as_dataset(val_data, "val_data", dtype=dtype) if val_data is not None else None
    test = _as_dataset(test_data, "test_data", dtype=dtype) if test_data is not None else None
    train, val, test = _split(train, val, test, config.data)
    user = UserComponents(
        model=model,
        train_data=train,
        val_data=val,
        loss_fn=loss_fn,
        collate_fn=collate_fn,
        test_data=test,
        metrics=tuple(metric_objects),
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


def _split(
    train: Dataset[Any], val: Dataset[Any] | None, test: Dataset[Any] | None, data: DataConfig
) -> tuple[Dataset[Any], Dataset[Any] | None, Dataset[Any] | None]:
    """``val_fraction`` and ``test_fraction`` split train when no such dataset is given."""
    if test is not None and data.test_fraction is not None:
        raise ConfigError(
            "fit: test_data and test_fraction are both given",
            hint="pass a test set or a fraction of train, not both",
        )
    val_fraction = data.val_fraction if val is None else None
    if val_fraction is None and data.test_fraction is None:
        return train, val, test
    train, val_part, test_part = split_train_val_test(
        train, val_fraction=val_fraction, test_fraction=data.test_fraction, seed=data.split_seed
    )
    return train, val if val is not None else val_part, test if test is not None else test_part


def _pop_callable(options: dict[str, Any], key: str, *kinds: type) -> Any:
    """Take ``key`` out of the options when it holds a callable (or one of ``kinds``)."""
    value = options.get(key)
    if value is not None and (callable(value) or isinstance(value, kinds)):
        del options[key]
        return value
    return None


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating-point parameters (None: it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _as_dataset(data: DataLike, argument: str, *, dtype: torch.dtype | None = None) -> Dataset[Any]:
    if isinstance(data, (Dataset, IterableDataset)):
        return data
    if (
        isinstance(data, (tuple, list))
        and data
        and all(isinstance(item, (torch.Tensor, np.ndarray)) for item in data)
    ):
        return ArrayDataset(*_cast_float64(data, argument, dtype))
    raise ConfigError(
        f"fit: {argument} must be a torch Dataset or a tuple of arrays, got {type(data).__name__}",
        hint=f"pass {argument}=(features, labels) or a torch.utils.data.Dataset",
    )


def _cast_float64(
    arrays: Sequence[torch.Tensor | np.ndarray], argument: str, dtype: torch.dtype | None
) -> list[torch.Tensor | np.ndarray]:
    """Float64 arrays cast (once, up front) to the model's float dtype, with one note.

    NumPy makes float64 by default and models are float32: without this the first
    forward fails on ``Double and Float``. One cast here costs one copy of the array;
    a cast per batch would cost it every epoch.
    """
    if dtype is None or dtype == torch.float64:
        return list(arrays)
    wide = [item.dtype in (np.float64, torch.float64) for item in arrays]
    if not any(wide):
        return list(arrays)
    name = str(dtype).removeprefix("torch.")
    logger.warning(
        "fit: %s holds float64 arrays and the model is %s: cast to %s once, up front "
        "(pass %s arrays to skip the copy)",
        argument,
        name,
        name,
        name,
    )
    return [
        (torch.from_numpy(item) if isinstance(item, np.ndarray) else item).to(dtype)
        if cast
        else item
        for item, cast in zip(arrays, wide, strict=True)
    ]
