"""Build the user's model, datasets, loss and collate from config names or import paths."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from stoker.config import ComponentSpec, RunConfig
from stoker.data.builtins import SOURCES
from stoker.data.collate import PadCollate
from stoker.data.sources import split_train_val_test
from stoker.errors import ConfigError, DataError
from stoker.examples.datasets import DATASETS as EXAMPLE_DATASETS
from stoker.examples.models import MODELS
from stoker.train import losses

if TYPE_CHECKING:
    from stoker.train.metrics import Task

#: The built-in losses. The elementwise ones align ``(N, 1)`` outputs with ``(N,)``
#: targets and refuse shapes that would broadcast (see ``stoker.train.losses``).
LOSSES: dict[str, Callable[..., nn.Module]] = {
    "cross_entropy": losses.CrossEntropyLoss,
    "nll": nn.NLLLoss,
    "bce_with_logits": losses.BCEWithLogitsLoss,
    "mse": losses.MSELoss,
    "l1": losses.L1Loss,
    "smooth_l1": losses.SmoothL1Loss,
    "huber": losses.HuberLoss,
}
COLLATES: dict[str, Callable[..., Any]] = {"pad": PadCollate}
DATASETS: dict[str, Callable[..., Any]] = {**SOURCES, **EXAMPLE_DATASETS}
CLASSIFICATION_LOSSES = frozenset({"cross_entropy", "nll", "bce_with_logits"})
REGRESSION_LOSSES = frozenset({"mse", "l1", "smooth_l1", "huber"})


def task_of(config: RunConfig) -> Task | None:
    """The run's task (``train.task``, else by the loss): training and a trained run's
    evaluate/predict must agree on it."""
    if config.train.task != "auto":
        return config.train.task
    if config.loss.name in CLASSIFICATION_LOSSES:
        return "classification"
    if config.loss.name in REGRESSION_LOSSES:
        return "regression"
    return None


def resolve_callable(
    spec: str, *, field: str, builtins: Mapping[str, Callable[..., Any]]
) -> Callable:
    """Turn a built-in name, ``package.module:attr`` or ``path/file.py:attr`` into a callable.

    Args:
        spec: What the config says.
        field: The config key it came from, named in errors.
        builtins: The built-in names allowed for this field.
    """
    if spec in builtins:
        return builtins[spec]
    module_name, sep, attr = spec.partition(":")
    if not sep or not attr:
        raise ConfigError(
            f"{field}: {spec!r} is neither a built-in name nor an import path",
            hint=f"use one of {', '.join(sorted(builtins))}, or `package.module:callable`",
        )
    module = _import_module(module_name, field=field, spec=spec)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ConfigError(
                f"{field}: {module_name!r} has no attribute {attr!r}",
                hint=f"check the name after ':' in {spec!r}",
            )
        target = getattr(target, part)
    if not callable(target):
        raise ConfigError(f"{field}: {spec!r} is not callable (it is a {type(target).__name__})")
    return target


def _import_module(module_name: str, *, field: str, spec: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ConfigError(f"{field}: file {path} not found (from {spec!r})")
        name = f"stoker_user_{path.stem}_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        loader_spec = importlib.util.spec_from_file_location(name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        loader_spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"{field}: cannot import module {module_name!r} (from {spec!r}): {exc}",
            hint="check the module path, or make it importable (pip install -e . / PYTHONPATH)",
        ) from None


def _call(
    spec: ComponentSpec,
    *,
    field: str,
    builtins: Mapping[str, Callable[..., Any]],
    defaults: Mapping[str, Any] | None = None,
) -> Any:
    """Call the factory with its args, plus ``defaults`` it accepts and the args lack."""
    factory = resolve_callable(spec.name, field=f"{field}.name", builtins=builtins)
    args = dict(spec.args)
    for key, value in (defaults or {}).items():
        if key not in args and accepts(factory, key):
            args[key] = value
    try:
        return factory(**args)
    except TypeError as exc:
        raise ConfigError(
            f"{field}: {spec.name}(**{spec.args}) failed: {exc}",
            hint=f"check the keys under {field}.args",
        ) from None


def accepts(factory: Callable, name: str) -> bool:
    """Whether ``factory`` takes a keyword argument ``name`` (by name, not ``**kwargs``)."""
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


def build_model(config: RunConfig) -> nn.Module:
    """The model the config names."""
    if config.model is None:
        raise ConfigError("model: required", hint="add a `model:` section with `name:` and `args:`")
    model = _call(config.model, field="model", builtins=MODELS)
    if not isinstance(model, nn.Module):
        raise ConfigError(
            f"model: {config.model.name} returned a {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def build_datasets(config: RunConfig) -> tuple[Dataset, Dataset | None]:
    """The training and (optional) validation datasets, split deterministically if asked.

    With ``data.test_fraction`` the training part leaves out the test share too.
    """
    train, val, _ = build_splits(config, test=False)
    return train, val


def build_splits(
    config: RunConfig, *, test: bool = True
) -> tuple[Dataset, Dataset | None, Dataset | None]:
    """The training, validation and test datasets (the last two optional).

    ``data.val_fraction`` and ``data.test_fraction`` split them off ``data.train`` with
    one seeded permutation (see ``split_train_val_test``). With ``test=False`` the test
    dataset ``data.test`` is not built (its part of a split is still left out of train).
    """
    data = config.data
    if data.train is None:
        raise ConfigError("data.train: required", hint="add `data: {train: {name: digits}}`")
    # Sources that can meet malformed records get the run's policy unless told otherwise.
    policy = {"bad_records": data.bad_records}
    train = _as_dataset(
        _call(data.train, field="data.train", builtins=DATASETS, defaults=policy), "data.train"
    )
    val = test_data = None
    if data.val is not None:
        if data.val_fraction is not None:
            raise ConfigError(
                "data.val and data.val_fraction are both set",
                hint="give a separate validation set or a fraction of train, not both",
            )
        val = _as_dataset(
            _call(data.val, field="data.val", builtins=DATASETS, defaults=policy), "data.val"
        )
    if data.test is not None and test:
        test_data = _as_dataset(
            _call(data.test, field="data.test", builtins=DATASETS, defaults=policy), "data.test"
        )
    if data.val_fraction is not None or data.test_fraction is not None:
        train, val_part, test_part = split_train_val_test(
            train,
            val_fraction=data.val_fraction,
            test_fraction=data.test_fraction,
            seed=data.split_seed,
        )
        val = val_part if val_part is not None else val
        test_data = test_part if test_part is not None else test_data
    return train, val, test_data


def _as_dataset(value: Any, field: str) -> Dataset:
    if isinstance(value, (Dataset, torch.utils.data.IterableDataset)):
        return value
    raise DataError(
        f"{field}: the factory returned a {type(value).__name__}, not a torch Dataset",
        hint="return a torch.utils.data.Dataset (or stoker.ArrayDataset over your arrays)",
    )


def build_loss(config: RunConfig) -> nn.Module | Callable:
    """The loss function the config names.

    A built-in loss that skips a target value (cross_entropy, nll) skips
    ``loss.ignore_index`` unless ``loss.args`` names its own, so the loss, the token
    count of ``normalize: tokens`` and the metrics all leave out the same padding.
    """
    defaults = {"ignore_index": config.loss.ignore_index} if config.loss.name in LOSSES else {}
    return _call(
        ComponentSpec(name=config.loss.name, args=config.loss.args),
        field="loss",
        builtins=LOSSES,
        defaults=defaults,
    )


def build_collate_fn(config: RunConfig) -> Callable | None:
    """The custom collate function, if the config names one."""
    spec = config.loader.collate_fn
    if spec is None:
        if config.loader.collate_args:
            raise ConfigError(
                "loader.collate_args is set but loader.collate_fn is not",
                hint="set loader.collate_fn=pad (or your own), or drop loader.collate_args",
            )
        return None
    factory = resolve_callable(spec, field="loader.collate_fn", builtins=COLLATES)
    if spec in COLLATES or config.loader.collate_args:
        # A built-in, or a factory configured with arguments: call it to get the function.
        return _call(
            ComponentSpec(name=spec, args=config.loader.collate_args),
            field="loader.collate_fn",
            builtins=COLLATES,
        )
    return factory


def build_callbacks(config: RunConfig) -> list[object]:
    """The callbacks the config names (``callbacks: [file.py:Class, ...]``), in order."""
    built = []
    for index, item in enumerate(config.callbacks):
        spec = ComponentSpec(name=item) if isinstance(item, str) else item
        built.append(_call(spec, field=f"callbacks[{index}]", builtins={}))
    return built


def build_step_fns(config: RunConfig) -> tuple[Callable | None, Callable | None]:
    """``train.step_fn`` and ``train.eval_fn``, imported (None where not set)."""
    train = config.train
    return tuple(  # type: ignore[return-value]
        resolve_callable(spec, field=f"train.{name}", builtins={}) if spec else None
        for name, spec in (("step_fn", train.step_fn), ("eval_fn", train.eval_fn))
    )
