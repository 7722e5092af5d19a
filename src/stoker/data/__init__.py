"""stoker.data: datasets, samplers, collate functions, loaders and device moves.

The names load on first use (PEP 562): ``stoker data inspect`` imports only the torch-free
modules it needs, while ``from stoker.data import build_loader`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Each public name and the module that defines it.
_EXPORTS = {
    "ArrayDataset": "stoker.data.sources",
    "BadRecordLog": "stoker.data.records",
    "BadSample": "stoker.data.records",
    "BlockShuffleSampler": "stoker.data.samplers",
    "ByteTokenizer": "stoker.data.tokenizers",
    "CachedDataset": "stoker.data.cache",
    "CharTokenizer": "stoker.data.tokenizers",
    "Compose": "stoker.data.transforms",
    "CsvDataset": "stoker.data.tabular",
    "EpochLoader": "stoker.data.loader",
    "EpochRandomSampler": "stoker.data.samplers",
    "EpochWeightedSampler": "stoker.data.weighted",
    "Fingerprint": "stoker.data.fingerprint",
    "ImageFolder": "stoker.data.images",
    "JsonlDataset": "stoker.data.text",
    "LengthBucketBatchSampler": "stoker.data.bucketing",
    "Normalize": "stoker.data.transforms",
    "NpyDataset": "stoker.data.memmap",
    "PackedBlocks": "stoker.data.packing",
    "PadCollate": "stoker.data.collate",
    "ParquetDataset": "stoker.data.parquet",
    "RandomCrop": "stoker.data.transforms",
    "RandomHorizontalFlip": "stoker.data.transforms",
    "RandomNoise": "stoker.data.transforms",
    "ReproducibleTransformDataset": "stoker.data.transforms",
    "Resize": "stoker.data.transforms",
    "SamplerName": "stoker.data.loader",
    "ShardStream": "stoker.data.streaming",
    "TextListDataset": "stoker.data.text",
    "ToTensor": "stoker.data.transforms",
    "balanced_weights": "stoker.data.weighted",
    "build_loader": "stoker.data.loader",
    "convert_csv": "stoker.data.convert",
    "dataset_targets": "stoker.data.sources",
    "default_collate": "stoker.data.collate",
    "epoch_seed": "stoker.data.samplers",
    "fingerprint_dataset": "stoker.data.fingerprint",
    "fingerprint_files": "stoker.data.fingerprint",
    "move_to_device": "stoker.data.device",
    "pack_documents": "stoker.data.packing",
    "pad_collate": "stoker.data.collate",
    "passthrough": "stoker.data.collate",
    "resolve_device": "stoker.data.device",
    "sample_generator": "stoker.data.transforms",
    "split_dataset": "stoker.data.sources",
    "token_count": "stoker.data.collate",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ loads them
    from stoker.data.bucketing import LengthBucketBatchSampler
    from stoker.data.cache import CachedDataset
    from stoker.data.collate import (
        PadCollate,
        default_collate,
        pad_collate,
        passthrough,
        token_count,
    )
    from stoker.data.convert import convert_csv
    from stoker.data.device import move_to_device, resolve_device
    from stoker.data.fingerprint import Fingerprint, fingerprint_dataset, fingerprint_files
    from stoker.data.images import ImageFolder
    from stoker.data.loader import EpochLoader, SamplerName, build_loader
    from stoker.data.memmap import NpyDataset
    from stoker.data.packing import PackedBlocks, pack_documents
    from stoker.data.parquet import ParquetDataset
    from stoker.data.records import BadRecordLog, BadSample
    from stoker.data.samplers import BlockShuffleSampler, EpochRandomSampler, epoch_seed
    from stoker.data.sources import ArrayDataset, dataset_targets, split_dataset
    from stoker.data.streaming import ShardStream
    from stoker.data.tabular import CsvDataset
    from stoker.data.text import JsonlDataset, TextListDataset
    from stoker.data.tokenizers import ByteTokenizer, CharTokenizer
    from stoker.data.transforms import (
        Compose,
        Normalize,
        RandomCrop,
        RandomHorizontalFlip,
        RandomNoise,
        ReproducibleTransformDataset,
        Resize,
        ToTensor,
        sample_generator,
    )
    from stoker.data.weighted import EpochWeightedSampler, balanced_weights

__all__ = [
    "ArrayDataset",
    "BadRecordLog",
    "BadSample",
    "BlockShuffleSampler",
    "ByteTokenizer",
    "CachedDataset",
    "CharTokenizer",
    "Compose",
    "CsvDataset",
    "EpochLoader",
    "EpochRandomSampler",
    "EpochWeightedSampler",
    "Fingerprint",
    "ImageFolder",
    "JsonlDataset",
    "LengthBucketBatchSampler",
    "Normalize",
    "NpyDataset",
    "PackedBlocks",
    "PadCollate",
    "ParquetDataset",
    "RandomCrop",
    "RandomHorizontalFlip",
    "RandomNoise",
    "ReproducibleTransformDataset",
    "Resize",
    "SamplerName",
    "ShardStream",
    "TextListDataset",
    "ToTensor",
    "balanced_weights",
    "build_loader",
    "convert_csv",
    "dataset_targets",
    "default_collate",
    "epoch_seed",
    "fingerprint_dataset",
    "fingerprint_files",
    "move_to_device",
    "pack_documents",
    "pad_collate",
    "passthrough",
    "resolve_device",
    "sample_generator",
    "split_dataset",
    "token_count",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'stoker.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
