"""``stoker data inspect`` without torch: CSV, Parquet and .npy read with numpy and pyarrow.

Importing torch is most of what ``stoker data inspect small.csv`` would cost (about two
seconds of a start that is otherwise a few tenths). So the common cases are read here
with the same torch-free code the datasets use (:mod:`stoker.data.csv_layout`,
:mod:`stoker.data.npy_fields`, :mod:`stoker.data.parquet_files`) and fingerprinted over
the same files, with the same sample count, as :func:`stoker.data.fingerprint_dataset`
fingerprints the dataset a run trains on: the digest printed is the one the run records.

Anything out of the common case (a bad row among those shown, a Parquet column that is
text or holds nulls, a .npy dtype whose torch name differs, a CSV over 64 MiB, an empty
data set) answers None, and the caller opens the data with the torch datasets instead,
which print the same lines or raise the error a run would.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Over this, reading the CSV costs more than importing torch: the datasets index it.
_CSV_MAX_BYTES = 64 << 20
# .npy dtypes named alike by numpy and torch (``str(torch.float32)`` is "torch.float32").
_SAME_NAMES = {
    "bool", "int8", "int16", "int32", "int64", "uint8",
    "float16", "float32", "float64", "complex64", "complex128",
}  # fmt: skip


@dataclass(frozen=True)
class Light:
    """What inspect prints about a data set, read without torch."""

    kind: str
    length: int
    schema: dict[str, str]
    samples: list[tuple[np.ndarray, ...]]  # the first ones, as many as asked for
    paths: list[Path]  # the files the run's fingerprint covers, in its order


def open_light(path: Path, rows: int, suffixes: set[str]) -> Light | None:
    """The data set at ``path`` with its first ``rows`` samples; None: use the datasets."""
    openers: dict[str, Callable[[Path, int], Light | None]] = {
        ".parquet": _parquet,
        ".npy": _npy,
        ".csv": _csv,
    }
    if path.is_dir():
        opener = openers.get(suffixes.pop()) if len(suffixes) == 1 else None
        opener = opener if opener in (_parquet, _npy) else None
    else:
        opener = openers.get(path.suffix)
    if opener is None:
        return None
    try:
        return opener(path, max(rows, 0))
    except Exception:  # the datasets raise the error a run would, with its hint
        return None


def _csv(path: Path, rows: int) -> Light | None:
    """As ``CsvDataset(path)``: every column a feature, no target, blank lines skipped."""
    from stoker.data.csv_layout import _layout, _parse_lines

    if path.stat().st_size > _CSV_MAX_BYTES:
        return None
    layout = _layout(path, features=None, target=None, delimiter=",", target_dtype="auto")
    data = path.read_bytes()[layout.header_bytes :]
    lines = data.split(b"\n") if data else []
    if lines and not lines[-1]:
        lines.pop()  # the last line ended with a newline
    last = len(lines) - 1
    # A blank line (as CsvDataset indexes them) ends with a newline and holds at most "\r".
    kept = [
        (number, raw)
        for number, raw in enumerate(lines)
        if raw not in (b"", b"\r") or (number == last and not data.endswith(b"\n"))
    ]
    shown = kept[: min(rows, len(kept))]
    # Line numbers count the header as line 1; a bad row raises, and the caller retries.
    parsed = _parse_lines([raw for _, raw in shown], [n + 2 for n, _ in shown], layout, "error")
    samples = [(features,) for features in parsed.features]
    schema = {name: "column" for name in layout.columns}
    return Light("csv", len(kept), schema, samples, [path])


def _parquet(path: Path, rows: int) -> Light | None:
    """As ``ParquetDataset(path)``: numeric columns, all features, read as float32."""
    from stoker.data.parquet_files import _parquet_files, require_pyarrow

    pa, pq = require_pyarrow("ParquetDataset")
    files = _parquet_files(path)
    handles = [pq.ParquetFile(file, pre_buffer=False) for file in files]
    names = handles[0].schema_arrow.names
    numeric = (pa.types.is_integer, pa.types.is_floating, pa.types.is_boolean)
    for handle in handles:
        schema = handle.schema_arrow
        if schema.names != names or len(set(names)) != len(names):
            return None
        if not all(any(check(field.type) for check in numeric) for field in schema):
            return None  # text, decimal or dictionary columns: the dataset's own rules
    samples: list[tuple[np.ndarray, ...]] = []
    for handle in handles:
        for group in range(handle.metadata.num_row_groups):
            if len(samples) >= rows:
                break
            table = handle.read_row_group(group, columns=names).slice(0, rows - len(samples))
            if any(column.null_count for column in table.columns):
                return None  # a bad record: the dataset raises it
            columns = [column.to_numpy().astype(np.float32) for column in table.columns]
            matrix = np.stack(columns, axis=1) if columns else np.empty((table.num_rows, 0))
            samples.extend((row,) for row in matrix.astype(np.float32, copy=False))
    length = sum(handle.metadata.num_rows for handle in handles)
    schema = {field.name: str(field.type) for field in handles[0].schema_arrow}
    return Light("parquet", length, schema, samples, list(files))


def _npy(path: Path, rows: int) -> Light | None:
    """As ``NpyDataset(path)``: one field per file, the target field second."""
    from stoker.data.npy_fields import _field_paths, _native, _open_npy

    names, paths = _field_paths(str(path) if path.is_dir() else [str(path)])
    arrays = [_open_npy(file) for file in paths]
    lengths = {array.shape[0] for array in arrays}
    if len(lengths) != 1 or not all(array.flags.c_contiguous for array in arrays):
        return None  # the dataset says what is wrong
    (length,) = lengths
    if not length or any(array.dtype.name not in _SAME_NAMES for array in arrays):
        return None
    samples = [
        tuple(_native(np.array(array[index])) for array in arrays)
        for index in range(min(rows, length))
    ]
    first = tuple(_native(np.array(array[0])) for array in arrays)
    schema = {
        name: f"{value.dtype} {list(value.shape)} per sample"
        for name, value in zip(names, first, strict=True)
    }
    return Light("npy", length, schema, samples, list(paths))


def is_array(value: Any) -> bool:
    """A numpy array or a torch tensor, without importing torch to ask."""
    import sys

    torch = sys.modules.get("torch")
    return isinstance(value, np.ndarray) or (torch is not None and isinstance(value, torch.Tensor))
