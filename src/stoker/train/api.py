"""``stoker.fit``: the Python entry point, with the config's options as keyword arguments."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
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

logger = logging.getLogger("stoker")

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
    **options: Any,
) -> FitResult:
    """Train ``model`` on ``train_data``, validating on ``val_data`` after each epoch.

    Every run-config option can be given by its own name — ``epochs``, ``batch_size``,
    ``lr``, ``precision``, ``grad_accum_steps``, ``clip_grad_norm``, ``run_dir``,
    ``seed`` … (the full list is ``stoker.config.FLAT_OPTIONS``); ``optimizer``,
    ``schedule`` and ``loss`` take the config's names. ``loss`` and ``collate_fn``
    may also be callables.

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

    Returns:
        The final metrics, the per-epoch history, the run dir and the trained model.
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"fit: model must be a torch.nn.Module, got {type(model).__name__}")
    loss_fn = _pop_callable(options, "loss")
    collate_fn = _pop_callable(options, "collate_fn")
    if loss_fn is not None and "loss" not in options:
        options["loss"] = getattr(loss_fn, "__name__", type(loss_fn).__name__)
    config = config_from_options(options)
    dtype = _float_dtype(model)
    train = _as_dataset(train_data, "train_data", dtype=dtype)
    val = _as_dataset(val_data, "val_data", dtype=dtype) if val_data is not None else None
    if val is None and config.data.val_fraction is not None:
        train, val = split_dataset(train, config.data.val_fraction, seed=config.data.split_seed)
    user = UserComponents(
        model=model, train_data=train, val_data=val, loss_fn=loss_fn, collate_fn=collate_fn
    )
    return train_run(
        config,
        user=user,
        resume=resume,
        progress=progress,
        allow_data_change=allow_data_change,
        allow_config_change=allow_config_change,
    )


def _pop_callable(options: dict[str, Any], key: str) -> Callable | None:
    value = options.get(key)
    if value is not None and callable(value):
        del options[key]
        return value
    return None


def _float_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's floating-point parameters (None: it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _as_dataset(data: DataLike, argument: str, *, dtype: torch.dtype | None = None) -> Dataset:
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
