"""stoker: keep the GPU fed — a PyTorch training pipeline that measures itself.

The public names load on first use (PEP 562): ``import stoker`` and the ``stoker`` CLI's
``--help`` do not import torch (about two seconds), while ``from stoker import fit``
works as usual and imports what ``fit`` needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: Each public name and the module that defines it.
_EXPORTS = {
    "ArrayDataset": "stoker.data.sources",
    "Callback": "stoker.train.callbacks",
    "CallbackError": "stoker.errors",
    "CheckpointError": "stoker.errors",
    "ConfigError": "stoker.errors",
    "DataError": "stoker.errors",
    "EpochLoader": "stoker.data.loader",
    "FitOptions": "stoker.train.fit_options",
    "FitResult": "stoker.train.session",
    "ModelError": "stoker.errors",
    "RunConfig": "stoker.config",
    "StepRecord": "stoker.train.callbacks",
    "StokerError": "stoker.errors",
    "TrainingError": "stoker.errors",
    "build_loader": "stoker.data.loader",
    "evaluate_run": "stoker.inference",
    "fit": "stoker.train.api",
    "load_config": "stoker.config",
    "load_model": "stoker.inference",
    "predict": "stoker.inference",
    "split_dataset": "stoker.data.sources",
    "train_run": "stoker.train.session",
}

__all__ = [
    "ArrayDataset",
    "Callback",
    "CallbackError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EpochLoader",
    "FitOptions",
    "FitResult",
    "ModelError",
    "RunConfig",
    "StepRecord",
    "StokerError",
    "TrainingError",
    "__version__",
    "build_loader",
    "evaluate_run",
    "fit",
    "load_config",
    "load_model",
    "predict",
    "split_dataset",
    "train_run",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads them
    from stoker.config import RunConfig, load_config
    from stoker.data.loader import EpochLoader, build_loader
    from stoker.data.sources import ArrayDataset, split_dataset
    from stoker.errors import (
        CallbackError,
        CheckpointError,
        ConfigError,
        DataError,
        ModelError,
        StokerError,
        TrainingError,
    )
    from stoker.inference import evaluate_run, load_model, predict
    from stoker.train.api import fit
    from stoker.train.callbacks import Callback, StepRecord
    from stoker.train.fit_options import FitOptions
    from stoker.train.session import FitResult, train_run


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stoker' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
