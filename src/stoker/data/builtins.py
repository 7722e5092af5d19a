"""The data sources a run config can name, with arguments that YAML can hold.

``data.train: {name: parquet, args: {path: data/train.parquet, target: label}}`` builds
``ParquetDataset("data/train.parquet", target="label")``; objects that YAML cannot
express (a tokenizer, a transform pipeline) are chosen here by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from stoker.data.images import ImageFolder, ImageMode
from stoker.data.memmap import NpyDataset
from stoker.data.parquet import ParquetDataset
from stoker.data.records import BadRecordPolicy
from stoker.data.streaming import ShardStream
from stoker.data.tabular import CsvDataset, TargetDtype
from stoker.data.text import JsonlDataset
from stoker.data.tokenizers import ByteTokenizer, CharTokenizer
from stoker.data.transforms import (
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    Resize,
    ToTensor,
)
from stoker.errors import ConfigError


def npy(
    path: str | dict[str, str] | list[str],
    *,
    mmap: bool = False,
    max_mapped_mib: int | None = 128,
    float64: Literal["keep", "float32"] = "float32",
) -> NpyDataset:
    """``.npy`` arrays, one file per field: a folder, a {name: file} mapping, or a list.

    ``mmap: false`` (the default here) reads rows by position, which keeps memory flat
    in a shuffled epoch; ``mmap: true`` maps the files (fastest for sequential reads),
    keeping at most about ``max_mapped_mib`` of them mapped (``null``: no limit, the
    fastest shuffled reads of a file that fits in memory, whose pages then count in RSS).
    ``float64: float32`` (the default here) reads float64 fields, NumPy's default dtype,
    as float32, the dtype of the model's weights, with a note; ``keep`` as stored.
    """
    return NpyDataset(path, mmap=mmap, max_mapped_mib=max_mapped_mib, float64=float64)


def parquet(
    path: str,
    *,
    features: Sequence[str] | None = None,
    target: str | None = None,
    bad_records: BadRecordPolicy = "error",
    cache_row_groups: int = 4,
) -> ParquetDataset:
    """A Parquet file or folder, read a row group and the needed columns at a time."""
    return ParquetDataset(
        path,
        features=features,
        target=target,
        bad_records=bad_records,
        cache_row_groups=cache_row_groups,
    )


def csv(
    path: str,
    *,
    features: Sequence[str] | None = None,
    target: str | None = None,
    delimiter: str = ",",
    bad_records: BadRecordPolicy = "error",
    target_dtype: TargetDtype = "auto",
) -> CsvDataset:
    """A CSV file with a header, read by line offset (`stoker data convert` makes it faster).

    ``target_dtype: float32`` reads an integer-valued target as a regression target
    (``auto`` would read it as class labels).
    """
    return CsvDataset(
        path,
        features=features,
        target=target,
        delimiter=delimiter,
        bad_records=bad_records,
        target_dtype=target_dtype,
    )


def jsonl(
    path: str,
    *,
    text_field: str = "text",
    label_field: str | None = "label",
    labels: Sequence[str] | None = None,
    tokenizer: str = "byte",
    max_length: int | None = 512,
    bad_records: BadRecordPolicy = "error",
) -> JsonlDataset:
    """JSON lines of text and label, tokenized by ``byte`` or ``char`` (fitted on the file)."""
    return JsonlDataset(
        path,
        text_field=text_field,
        label_field=label_field,
        labels=labels,
        tokenizer=_tokenizer(tokenizer, max_length, path=path, text_field=text_field),
        bad_records=bad_records,
    )


def _tokenizer(name: str, max_length: int | None, *, path: str, text_field: str) -> Any:
    if name == "byte":
        return ByteTokenizer(max_length=max_length)
    if name == "char":
        texts = JsonlDataset(path, text_field=text_field, label_field=None)
        return CharTokenizer.fit((texts[i] for i in range(len(texts))), max_length=max_length)
    raise ConfigError(
        f"data.train.args.tokenizer: {name!r} is not one of byte, char",
        hint="set tokenizer: byte (UTF-8 bytes, vocab_size 257)",
    )


def image_folder(
    root: str,
    *,
    mode: ImageMode | None = None,
    size: int | None = None,
    augment: bool = False,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    bad_records: BadRecordPolicy = "error",
    seed: int = 0,
) -> ImageFolder:
    """One sub-folder per class, as float CHW tensors.

    ``mode`` is ``keep`` (each file's own), ``L``, ``RGB`` or ``RGBA``; unset, images
    become RGB and a file of another mode is logged once. ``size`` resizes to size×size;
    ``augment`` adds a padded random crop and a horizontal flip, seeded by (seed, epoch,
    index) so the number of workers does not change them.
    """
    steps: list[Any] = [ToTensor()]  # the random transforms work on tensors
    if size is not None:
        steps.append(Resize((size, size)))  # square, so images of any shape batch together
        if augment:
            steps.append(RandomCrop(size, padding=max(1, size // 8)))
    if augment:
        steps.append(RandomHorizontalFlip())
    if mean is not None and std is not None:
        steps.append(Normalize(mean, std))
    return ImageFolder(
        root, transform=Compose(steps), mode=mode, bad_records=bad_records, seed=seed
    )


def shards(
    path: str | list[str],
    *,
    shuffle_buffer: int = 0,
    seed: int = 0,
    uneven: str = "drop",
    bad_records: BadRecordPolicy = "error",
) -> ShardStream:
    """A stream over shard files (a glob or a list): ``.jsonl``, ``.npy`` or ``.pt``.

    ``bad_records`` (``data.bad_records`` unless given): a ``.jsonl`` line that does not
    parse stops the run (``error``) or is dropped and logged (``skip``).
    """
    return ShardStream(
        path,
        shuffle_buffer=shuffle_buffer,
        seed=seed,
        uneven=uneven,  # type: ignore[arg-type]
        bad_records=bad_records,
    )


SOURCES = {
    "csv": csv,
    "image_folder": image_folder,
    "jsonl": jsonl,
    "npy": npy,
    "parquet": parquet,
    "shards": shards,
}
