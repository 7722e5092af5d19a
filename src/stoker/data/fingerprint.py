"""Content fingerprints of training data, recorded with each run and checked on resume.

A fingerprint is a SHA-256 digest of what a dataset holds, computed one of two ways:

- ``fast`` (the default) reads a bounded amount of data however large the dataset is:
  for files, each file's relative name, its size and 16 blocks of 64 KiB at fixed
  positions (first, last and 14 evenly spaced between); for arrays, dtypes, shapes and
  about 1 MiB of evenly spaced rows; for other datasets, the length and 32 evenly spaced
  samples. It catches a replaced, resized, added or removed file and most edits, but it
  can miss a change that lies wholly outside the sampled blocks, rows or samples.
- ``full`` reads every byte (or every sample). It catches any change, at the cost of one
  pass over the data.

Two fingerprints compare only in the same mode, so on resume the caller recomputes in
the mode that was saved (:func:`verify_dataset` does both steps).
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import ConcatDataset, IterableDataset, Subset, TensorDataset

from stoker.data.cache import CachedDataset
from stoker.data.sources import ArrayDataset
from stoker.errors import DataError
from stoker.safe_files import write_text

__all__ = [
    "FINGERPRINT_FILE",
    "Fingerprint",
    "FingerprintKind",
    "FingerprintMode",
    "check_fingerprint",
    "fingerprint_dataset",
    "fingerprint_files",
    "read_fingerprint",
    "verify_dataset",
    "write_fingerprint",
]

from stoker.data.digests import (
    _CHUNK_BYTES,
    FINGERPRINT_FILE,
    Fingerprint,
    FingerprintKind,
    FingerprintMode,
    _as_paths,
    _hasher,
    _update_int,
    fingerprint_files,
)

_ROW_BUDGET_BYTES = 1024 * 1024
_MIN_ROWS = 32
_SAMPLES = 32
_SAMPLE_SEED = 0
_PATH_ATTRIBUTES = ("fingerprint_paths", "path", "root", "paths")


# ---------------------------------------------------------------- arrays and samples


def _spread(n: int, count: int) -> list[int]:
    """``count`` indices spread evenly over ``range(n)``, first and last included."""
    if count >= n:
        return list(range(n))
    if count == 1:
        return [0]
    return sorted({i * (n - 1) // (count - 1) for i in range(count)})


def _update_tensor(hasher: Any, tensor: torch.Tensor) -> None:
    # .cpu() waits for a GPU tensor's pending work (a CPU–GPU sync); fingerprints run once.
    tensor = tensor.detach().cpu()
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    hasher.update(f"tensor|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
    # A byte view works for every dtype, including those numpy lacks (bfloat16, float8).
    hasher.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _update_ndarray(hasher: Any, array: np.ndarray) -> None:
    hasher.update(f"ndarray|{array.dtype.str}|{array.shape}|".encode())
    if array.dtype.hasobject:
        # Object arrays hold pointers; their items' values are what counts.
        for item in array.reshape(-1):
            _update_value(hasher, item)
    else:
        hasher.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def _update_value(hasher: Any, value: Any) -> None:
    """Hash one sample (tensors, arrays, containers, plain values) by its content."""
    if isinstance(value, torch.Tensor):
        _update_tensor(hasher, value)
    elif isinstance(value, np.ndarray):
        _update_ndarray(hasher, value)
    elif isinstance(value, Mapping):
        hasher.update(f"map|{len(value)}|".encode())
        for key in sorted(value, key=repr):
            hasher.update(f"{key!r}=".encode())
            _update_value(hasher, value[key])
    elif isinstance(value, list | tuple):
        hasher.update(f"seq|{len(value)}|".encode())
        for item in value:
            _update_value(hasher, item)
    elif isinstance(value, str | bytes | int | float | complex | bool | np.generic) or (
        value is None
    ):
        hasher.update(f"{type(value).__name__}|{value!r}|".encode())
    elif hasattr(value, "__array_interface__") or hasattr(value, "__array__"):
        # PIL images and other array-likes: their pixels or values.
        _update_ndarray(hasher, np.asarray(value))
    elif hasattr(value, "__dict__"):
        # The default repr holds a memory address, which differs run to run.
        hasher.update(f"object|{type(value).__qualname__}|".encode())
        _update_value(hasher, vars(value))
    else:
        hasher.update(f"{type(value).__qualname__}|{value!r}|".encode())


def _array_fingerprint(arrays: Sequence[torch.Tensor | np.ndarray], *, full: bool) -> Fingerprint:
    mode: FingerprintMode = "full" if full else "fast"
    hasher = _hasher("arrays", mode)
    n = int(arrays[0].shape[0]) if arrays[0].ndim else 1
    total = 0
    for array in arrays:
        rows = int(array.shape[0]) if array.ndim else 1
        nbytes = array.nbytes if isinstance(array, np.ndarray) else array.numel() * array.itemsize
        total += nbytes
        dtype = array.dtype.str if isinstance(array, np.ndarray) else str(array.dtype)
        hasher.update(f"array|{dtype}|{tuple(array.shape)}|".encode())
        if array.ndim == 0:
            _update_value(hasher, array)
            continue
        row_bytes = max(nbytes // max(rows, 1), 1)
        if full:
            # Row chunks bound the memory a non-contiguous or memory-mapped array needs.
            step = max(_CHUNK_BYTES // row_bytes, 1)
            for start in range(0, rows, step):
                _update_value(hasher, array[start : start + step])
        else:
            count = max(_ROW_BUDGET_BYTES // row_bytes, _MIN_ROWS)
            index = _spread(rows, count)
            _update_value(hasher, array[index])
    return Fingerprint(hasher.hexdigest(), "arrays", mode, num_samples=n, size_bytes=total)


def _sample_fingerprint(dataset: Any, length: int, *, full: bool) -> Fingerprint:
    mode: FingerprintMode = "full" if full else "fast"
    hasher = _hasher("samples", mode)
    _update_int(hasher, length)
    indices = range(length) if full else _spread(length, _SAMPLES)
    # Fixed seeds make random augmentation inside __getitem__ repeatable, so it does not
    # look like a data change; the callers' RNG states are restored afterwards.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SAMPLE_SEED)
            random.seed(_SAMPLE_SEED)
            np.random.seed(_SAMPLE_SEED)
            for i in indices:
                hasher.update(f"sample|{i}|".encode())
                _update_value(hasher, dataset[i])
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return Fingerprint(hasher.hexdigest(), "samples", mode, num_samples=length)


def _combine(kind: str, parts: Sequence[Fingerprint], extra: bytes, **counts: Any) -> Fingerprint:
    hasher = _hasher(kind, parts[0].mode)
    for part in parts:
        hasher.update(f"{part.kind}|{part.digest}|".encode())
    hasher.update(extra)
    return Fingerprint(hasher.hexdigest(), kind, parts[0].mode, **counts)  # type: ignore[arg-type]


def _path_attribute(dataset: Any) -> list[Path] | None:
    """Files a dataset names through ``fingerprint_paths()``, ``path``, ``root`` or ``paths``."""
    for name in _PATH_ATTRIBUTES:
        value = getattr(dataset, name, None)
        if value is None:
            continue
        if name == "fingerprint_paths":
            return _as_paths(value() if callable(value) else value)
        candidates = value if isinstance(value, list | tuple) else [value]
        if candidates and all(isinstance(p, str | os.PathLike) for p in candidates):
            paths = [Path(p) for p in candidates]
            if all(p.exists() for p in paths):
                return paths
    return None


def fingerprint_dataset(dataset: Any, *, full: bool = False) -> Fingerprint:
    """Fingerprint what a dataset holds, in the cheapest way that sees its content.

    In order: a ``CachedDataset`` by the dataset it wraps; a ``Subset`` by its base and
    its indices; a ``ConcatDataset`` by its parts; a dataset with a ``fingerprint_paths()``
    method (file-backed stoker sources) or a ``path``, ``root`` or ``paths`` attribute
    naming existing files or folders by those files (its length enters the digest); an
    ``ArrayDataset``, ``TensorDataset``, tensor or numpy array by dtypes,
    shapes and rows; a stream (no ``__len__``) by its ``shards`` files, or else as
    ``unknown``; any other map-style dataset by its length and its samples, read under
    fixed seeds so random augmentation does not change the result.

    Args:
        dataset: Any dataset, tensor or array.
        full: Read every byte or sample instead of a fixed-size sample of them.

    Returns:
        The fingerprint.

    Raises:
        DataError: Named files are missing.
    """
    mode: FingerprintMode = "full" if full else "fast"
    try:
        length: int | None = len(dataset)
    except TypeError:  # a stream
        length = None
    if isinstance(dataset, CachedDataset):
        return fingerprint_dataset(dataset.dataset, full=full)
    if isinstance(dataset, Subset):
        base = fingerprint_dataset(dataset.dataset, full=full)
        indices = dataset.indices
        if not isinstance(indices, torch.Tensor | np.ndarray):
            indices = list(indices)
        raw = torch.as_tensor(indices, dtype=torch.long).numpy().tobytes()
        counts = {"size_bytes": base.size_bytes, "files": base.files}
        return _combine(base.kind, [base], b"subset|" + raw, num_samples=length, **counts)
    if isinstance(dataset, ConcatDataset):
        parts = [fingerprint_dataset(part, full=full) for part in dataset.datasets]
        kinds = {part.kind for part in parts}
        kind = "unknown" if "unknown" in kinds else kinds.pop() if len(kinds) == 1 else "samples"
        return _combine(kind, parts, b"concat", num_samples=length)
    paths = _path_attribute(dataset)
    if paths is not None:
        return fingerprint_files(paths, full=full, num_samples=length)
    if isinstance(dataset, ArrayDataset):
        return _array_fingerprint(dataset.arrays, full=full)
    if isinstance(dataset, TensorDataset):
        return _array_fingerprint(dataset.tensors, full=full)
    if isinstance(dataset, torch.Tensor | np.ndarray):
        return _array_fingerprint([dataset], full=full)
    if length is None or isinstance(dataset, IterableDataset):
        shards = getattr(dataset, "shards", None)
        if shards:
            return fingerprint_files(_as_paths(shards), full=full, num_samples=length)
        hasher = _hasher("unknown", mode)
        hasher.update(type(dataset).__qualname__.encode())
        return Fingerprint(hasher.hexdigest(), "unknown", mode, num_samples=length)
    return _sample_fingerprint(dataset, length, full=full)


# ---------------------------------------------------------------- checking and storing


def check_fingerprint(
    saved: Fingerprint | Mapping[str, Any],
    current: Fingerprint,
    *,
    allow_change: bool = False,
) -> str | None:
    """Compare the data of the run being resumed with the data now given.

    Compute ``current`` in ``saved.mode`` (see :func:`verify_dataset`). Data that cannot
    be fingerprinted (kind ``unknown`` on either side) is never called equal, but does
    not stop a resume either: a warning says it was not checked.

    Args:
        saved: The fingerprint recorded by the run (or its :meth:`Fingerprint.to_dict`).
        current: The fingerprint of the data given now.
        allow_change: Return a warning instead of raising when the data differs.

    Returns:
        None when the data is the same; otherwise a warning for the log.

    Raises:
        DataError: The data differs (or the modes differ) and ``allow_change`` is false.
    """
    if not isinstance(saved, Fingerprint):
        saved = Fingerprint.from_dict(saved)
    if "unknown" in (saved.kind, current.kind):
        return (
            "the training data was not checked against the run being resumed: it cannot be "
            f"fingerprinted (saved: {saved.describe()}; now: {current.describe()})"
        )
    if saved.mode != current.mode:
        message = (
            f"cannot compare a {current.mode} data fingerprint with the {saved.mode} one "
            "saved by the run being resumed"
        )
        hint = f"recompute it with fingerprint_dataset(dataset, full={saved.mode == 'full'})"
    elif (saved.digest, saved.kind) != (current.digest, current.kind):
        message = (
            "the training data differs from the run being resumed:\n"
            f"    saved: {saved.describe()}\n"
            f"    now:   {current.describe()}"
        )
        hint = (
            "point the run at the data it was trained on, or pass --allow-data-change to "
            "resume anyway"
        )
    else:
        return None
    if allow_change:
        return f"{message} (resuming anyway: data changes are allowed)"
    raise DataError(message, hint=hint)


def verify_dataset(
    dataset: Any, saved: Fingerprint | Mapping[str, Any], *, allow_change: bool = False
) -> str | None:
    """Fingerprint ``dataset`` in the saved mode and :func:`check_fingerprint` it."""
    if not isinstance(saved, Fingerprint):
        saved = Fingerprint.from_dict(saved)
    current = fingerprint_dataset(dataset, full=saved.mode == "full")
    return check_fingerprint(saved, current, allow_change=allow_change)


def write_fingerprint(fingerprint: Fingerprint, run_dir: str | os.PathLike[str]) -> Path:
    """Write ``data_fingerprint.json`` into the run dir, atomically; returns its path."""
    target = Path(run_dir) / FINGERPRINT_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    write_text(target, json.dumps(fingerprint.to_dict(), indent=2) + "\n")
    return target


def read_fingerprint(run_dir: str | os.PathLike[str]) -> Fingerprint | None:
    """Read the run dir's ``data_fingerprint.json``; None when the run recorded none.

    Raises:
        DataError: The file is not a fingerprint.
    """
    source = Path(run_dir) / FINGERPRINT_FILE
    if not source.is_file():
        return None
    try:
        data = json.loads(source.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"it holds a {type(data).__name__}")
    except (ValueError, UnicodeDecodeError) as error:
        raise DataError(
            f"{source} is not a data fingerprint: {error}.",
            hint=f"delete {source} to skip the check, or resume with --allow-data-change",
        ) from error
    return Fingerprint.from_dict(data)
