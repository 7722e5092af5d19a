"""The data-to-loss half of a run, built from config: model, datasets, loss, loaders.

``train_run`` trains on it; ``stoker doctor``, ``stoker tune`` and ``stoker explain``
measure or show the same pipeline without training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from stoker import components
from stoker.config import RunConfig
from stoker.data.cache import CachedDataset
from stoker.data.cache_arrays import materialize
from stoker.data.device import resolve_device
from stoker.data.image_cache import DecodedImages
from stoker.data.images import ImageFolder
from stoker.data.loader import EpochLoader, build_loader
from stoker.distributed.sharding import rank_share
from stoker.errors import ConfigError
from stoker.train.losses import align_user_loss
from stoker.train.metric_set import NO_METRICS, Metrics, build_metrics


@dataclass(frozen=True)
class UserComponents:
    """Python objects given to ``stoker.fit`` instead of config names."""

    model: nn.Module | None = None
    train_data: Dataset | None = None
    val_data: Dataset | None = None
    loss_fn: Callable | None = None
    collate_fn: Callable | None = None
    test_data: Dataset | None = None
    #: Metric functions and objects, each with its key (None: from its name).
    metrics: tuple[tuple[str | None, Any], ...] = ()
    #: An optimizer or a factory ``params -> Optimizer``; a scheduler or ``optimizer ->
    #: scheduler``; callbacks; ``step_fn``/``eval_fn`` (see ``stoker.train.objective``).
    optimizer: Any = None
    scheduler: Any = None
    callbacks: tuple[object, ...] = ()
    step_fn: Callable | None = None
    eval_fn: Callable | None = None


@dataclass(frozen=True)
class Pipeline:
    """The data-to-loss half of a run: what the doctor and the tuner measure too."""

    config: RunConfig
    device: torch.device
    model: nn.Module
    train_data: Dataset
    val_data: Dataset | None
    loss_fn: Callable
    collate_fn: Callable | None
    train_loader: EpochLoader
    val_loader: EpochLoader | None
    #: Evaluated once at the end of a run (``data.test``, ``data.test_fraction``); its
    #: loader is built then (``build_eval_loader``), so no worker waits through training.
    test_data: Dataset | None = None
    #: ``train.metrics`` and ``stoker.fit(metrics=...)``, for validation and test.
    metrics: Metrics = NO_METRICS


def build_pipeline(config: RunConfig, user: UserComponents = UserComponents()) -> Pipeline:
    """Build model, datasets, loss and loaders from config (``user`` objects win)."""
    device = resolve_device(config.train.device)
    model = user.model if user.model is not None else components.build_model(config)
    test_data: Dataset | None
    if user.train_data is not None:
        train_data, val_data, test_data = user.train_data, user.val_data, user.test_data
    else:
        train_data, val_data, test_data = components.build_splits(config)
    if user.loss_fn is not None:
        # PyTorch's own elementwise losses align (N, 1) with (N,) as the built-ins do.
        loss_fn = align_user_loss(user.loss_fn)
    else:
        loss_fn = components.build_loss(config)
    collate_fn = user.collate_fn or components.build_collate_fn(config)
    train_data = _cached(config, train_data)
    train_loader = build_train_loader(config, train_data, device=device, collate_fn=collate_fn)
    val_loader = None
    if val_data is not None:
        val_loader = build_eval_loader(config, val_data, device=device, collate_fn=collate_fn)
    return Pipeline(
        config=config,
        device=device,
        model=model,
        train_data=train_data,
        val_data=val_data,
        loss_fn=loss_fn,
        collate_fn=collate_fn,
        train_loader=train_loader,
        val_loader=val_loader,
        test_data=test_data,
        metrics=build_metrics(config.train.metrics, user.metrics),
    )


def build_eval_loader(
    config: RunConfig, dataset: Dataset, *, device: torch.device, collate_fn: Callable | None
) -> EpochLoader:
    """The loader of validation (or test) data: in order, ``loader.val_batch_size``.

    DDP: each rank evaluates its share and the metric sums are reduced. FSDP needs every
    rank in every forward, so there each rank evaluates the whole set.
    """
    loader_cfg = config.loader
    return build_loader(
        dataset if config.distributed.strategy == "fsdp" else rank_share(dataset),
        batch_size=loader_cfg.val_batch_size or loader_cfg.batch_size,
        num_workers=loader_cfg.num_workers,
        pin_memory=loader_cfg.pin_memory,
        persistent_workers=loader_cfg.persistent_workers,
        prefetch_factor=loader_cfg.prefetch_factor,
        collate_fn=collate_fn,
        seed=config.seed,
        device=device,
        timeout_s=loader_cfg.timeout_s,
        split_across_ranks=False,  # already this rank's share (DDP), or all of it (FSDP)
    )


def cached_train_data(config: RunConfig, dataset: Dataset) -> Dataset:
    """``dataset`` behind the cache ``data.cache`` asks for, as a run gets it (the
    doctor's and the tuner's short runs measure exactly what training would use)."""
    return _cached(config, dataset)


def _cached(config: RunConfig, dataset: Dataset) -> Dataset:
    """Wrap the training data in a cache when ``data.cache`` asks for one."""
    data = config.data
    if data.cache == "none":
        return dataset
    if data.cache == "disk" and data.cache_path is None:
        raise ConfigError(
            "data.cache=disk needs a folder for the cache",
            hint="set data.cache_path=/fast/disk/cache-<name>",
        )
    if isinstance(dataset, ImageFolder):  # decoded once; crops and flips replayed per batch
        return DecodedImages(dataset, path=data.cache_path if data.cache == "disk" else None)
    if data.cache == "memory" and (arrays := materialize(dataset)) is not None:
        return arrays  # deterministic samples, read once into arrays: batched gathers
    cached = CachedDataset(dataset, mode=data.cache, path=data.cache_path)
    if data.cache == "memory" and config.loader.num_workers > 0:
        # Fill it before the workers fork, so they share it instead of each filling a copy.
        cached.warm()
    return cached


def build_train_loader(
    config: RunConfig,
    dataset: Dataset,
    *,
    device: torch.device,
    collate_fn: Callable | None,
    **overrides: Any,
) -> EpochLoader:
    """The training loader from ``config.loader``; ``overrides`` replace single knobs."""
    loader_cfg = config.loader
    options: dict[str, Any] = {
        "batch_size": loader_cfg.batch_size,
        "shuffle": _shuffle(loader_cfg.shuffle, dataset),
        "drop_last": loader_cfg.drop_last,
        "sampler": loader_cfg.sampler,
        "weights": loader_cfg.weights,
        "num_workers": loader_cfg.num_workers,
        "pin_memory": loader_cfg.pin_memory,
        "persistent_workers": loader_cfg.persistent_workers,
        "prefetch_factor": loader_cfg.prefetch_factor,
        "bucket_size_multiplier": loader_cfg.bucket_size_multiplier,
        "timeout_s": loader_cfg.timeout_s,
    }
    options.update(overrides)
    return build_loader(dataset, collate_fn=collate_fn, seed=config.seed, device=device, **options)


def _shuffle(setting: bool | str, dataset: Dataset) -> bool:
    if setting == "auto":
        return not isinstance(dataset, IterableDataset)
    return bool(setting)
