"""stoker.data: datasets, samplers, collate functions, loaders and device moves."""

from stoker.data.bucketing import LengthBucketBatchSampler
from stoker.data.cache import CachedDataset
from stoker.data.collate import PadCollate, default_collate, pad_collate, passthrough, token_count
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
