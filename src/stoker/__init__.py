"""stoker: keep the GPU fed — a PyTorch training pipeline that measures itself."""

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
from stoker.train.api import fit
from stoker.train.callbacks import Callback, StepRecord
from stoker.train.session import FitResult, train_run

__version__ = "0.1.0"

__all__ = [
    "ArrayDataset",
    "Callback",
    "CallbackError",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "EpochLoader",
    "FitResult",
    "ModelError",
    "RunConfig",
    "StepRecord",
    "StokerError",
    "TrainingError",
    "__version__",
    "build_loader",
    "fit",
    "load_config",
    "split_dataset",
    "train_run",
]
