"""stoker.data: datasets, samplers, collate functions, loaders and device moves."""

from stoker.data.collate import default_collate, passthrough
from stoker.data.device import move_to_device, resolve_device
from stoker.data.loader import EpochLoader, SamplerName, build_loader
from stoker.data.samplers import (
    EpochRandomSampler,
    EpochWeightedSampler,
    balanced_weights,
    epoch_seed,
)
from stoker.data.sources import ArrayDataset, dataset_targets, split_dataset

__all__ = [
    "ArrayDataset",
    "EpochLoader",
    "EpochRandomSampler",
    "EpochWeightedSampler",
    "SamplerName",
    "balanced_weights",
    "build_loader",
    "dataset_targets",
    "default_collate",
    "epoch_seed",
    "move_to_device",
    "passthrough",
    "resolve_device",
    "split_dataset",
]
