"""ParquetDataset: rows of Parquet files as samples, read by row group with a small cache."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stoker.data.csv_layout import check_policy, resolve_columns
from stoker.data.memmap import normalize_indices
from stoker.data.parquet_files import _parquet_files, require_pyarrow
from stoker.data.records import BadRecordPolicy, BadSample, FilteredBatch, bad_record, first_sample
from stoker.data.tabular import as_batch
from stoker.errors import ConfigError, DataError

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

__all__ = ["ParquetDataset", "require_pyarrow"]


def _kind(pa: ModuleType, dtype: pa.DataType) -> str:
    """``number`` (read as is), ``text`` (parsed per value) or ``other`` (not supported)."""
    types = pa.types
    if types.is_dictionary(dtype):
        return _kind(pa, dtype.value_type)
    if types.is_integer(dtype) or types.is_floating(dtype) or types.is_boolean(dtype):
        return "number"
    if types.is_decimal(dtype):
        return "number"
    if types.is_string(dtype) or types.is_large_string(dtype):
        return "text"
    return "other"


@dataclass(frozen=True)
class _Group:
    """One decoded row group: its features, target, and the reasons its bad rows are bad."""

    features: np.ndarray
    target: np.ndarray | None
    bad_rows: np.ndarray  # sorted rows within the group
    reasons: dict[int, str]


class ParquetDataset(Dataset[Any]):
    """Rows of one Parquet file or a folder of them as samples ``(features, target)``.

    Opening reads only the metadata (row-group sizes and the schema). A fetch reads
    only the row groups its rows fall in, and only the feature and target columns;
    the last ``cache_row_groups`` decoded groups are kept, so sequential or bucketed
    access decodes each group once. Peak memory is about ``cache_row_groups`` decoded
    groups, never a whole file.

    A fully shuffled epoch touches nearly every row group in every batch; keep row
    groups and the number of groups small, or shuffle within windows of row groups
    (see :meth:`row_group_offsets`), or convert to .npy for random access.

    Values: numeric and boolean columns are read as they are; string columns are parsed
    as numbers. A null or a string that is not a number is a bad record: under
    ``bad_records="error"`` it raises :class:`BadRecordError` naming the file, the row
    (within the file and in the dataset) and the column; under ``"skip"`` the batch
    comes back as a :class:`FilteredBatch` without it.

    Picklable for DataLoader workers: each process opens its own file handles.
    """

    #: ``__getitems__`` returns one collated batch, not a list of samples.
    returns_batches = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        features: Sequence[str] | None = None,
        target: str | None = None,
        bad_records: BadRecordPolicy = "error",
        cache_row_groups: int = 4,
    ) -> None:
        """Read the metadata of every file and check the columns.

        Args:
            path: A ``.parquet`` file, or a folder whose ``*.parquet`` files (sorted by
                name) are read as one dataset.
            features: Feature columns, in sample order (default: every column but the
                target; all must then be numeric).
            target: The target column; None gives samples ``(features,)``. Integer and
                boolean targets become int64, others float32.
            bad_records: ``error`` raises at a bad row; ``skip`` leaves it out of the batch.
            cache_row_groups: Decoded row groups kept per process (0: none).

        Raises:
            ConfigError: pyarrow is missing, or an invalid option.
            DataError: A missing path, a file that is not Parquet, a named column a file
                lacks, or a column whose type is not numbers or text.
        """
        check_policy(bad_records, "ParquetDataset")
        if (
            isinstance(cache_row_groups, bool)
            or not isinstance(cache_row_groups, int)
            or cache_row_groups < 0
        ):
            raise ConfigError(
                f"ParquetDataset cache_row_groups must be an int >= 0; got {cache_row_groups!r}.",
                hint="use cache_row_groups=4",
            )
        pa, pq = require_pyarrow("ParquetDataset")
        self._files = _parquet_files(Path(path))
        self._policy: BadRecordPolicy = bad_records
        self._cache_size = cache_row_groups
        handles, group_file, group_index, group_rows, file_rows = [], [], [], [], []
        chosen: Sequence[str] | None = features
        integer_target = target is not None
        for number, file in enumerate(self._files):
            handle = _open(pq, file)
            schema = handle.schema_arrow
            # The first file decides the default features; every other file must have them.
            chosen, target = resolve_columns(
                schema.names, features=chosen, target=target, source=str(file)
            )
            _check_types(pa, file, schema, chosen, target, defaulted=features is None)
            if target is not None:
                target_type = schema.field(target).type
                if pa.types.is_dictionary(target_type):
                    target_type = target_type.value_type
                integer_target &= pa.types.is_integer(target_type) or pa.types.is_boolean(
                    target_type
                )
            metadata = handle.metadata
            file_rows.append(metadata.num_rows)
            for group in range(metadata.num_row_groups):
                rows = metadata.row_group(group).num_rows
                if rows:
                    group_file.append(number)
                    group_index.append(group)
                    group_rows.append(rows)
            handles.append(handle)
        assert chosen is not None
        self._features = tuple(chosen)
        self._target = target
        self._columns = [*chosen, *([target] if target is not None else [])]
        self._target_dtype = np.int64 if integer_target else np.float32
        self._group_file = np.asarray(group_file, dtype=np.int64)
        self._group_index = np.asarray(group_index, dtype=np.int64)
        self._group_start = np.concatenate(([0], np.cumsum(group_rows, dtype=np.int64)))
        self._file_start = np.concatenate(([0], np.cumsum(file_rows, dtype=np.int64)))
        self._length = int(self._group_start[-1])
        self._schema = {f.name: str(f.type) for f in handles[0].schema_arrow}
        self._handles = list(handles)
        self._pid = os.getpid()
        self._cache: OrderedDict[int, _Group] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # File handles and decoded groups belong to one process; workers open their own.
        state["_handles"] = None
        state["_cache"] = OrderedDict()
        return state

    def _this_process(self) -> None:
        """In a new (forked or spawned) process, drop handles and groups of the old one."""
        if self._handles is None or self._pid != os.getpid():
            self._handles = [None] * len(self._files)
            self._cache = OrderedDict()
            self._pid = os.getpid()

    def _handle(self, file: int) -> pq.ParquetFile:
        assert self._handles is not None
        handle = self._handles[file]
        if handle is None:
            _, pq = require_pyarrow("ParquetDataset")
            handle = self._handles[file] = _open(pq, self._files[file])
        return handle

    @property
    def files(self) -> tuple[Path, ...]:
        """The Parquet files, in dataset order."""
        return tuple(self._files)

    def fingerprint_paths(self) -> list[Path]:
        """The files whose content the data fingerprint covers."""
        return list(self._files)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The feature columns, in the order of the features tensor."""
        return self._features

    @property
    def target_name(self) -> str | None:
        """The target column; None when samples are features alone."""
        return self._target

    def schema(self) -> dict[str, str]:
        """Every column of the (first) file and its Arrow type, e.g. ``{"x1": "float"}``."""
        return dict(self._schema)

    def row_group_offsets(self) -> list[int]:
        """Dataset index of the first row of each row group, then the number of rows.

        Row group ``g`` holds samples ``offsets[g]`` to ``offsets[g + 1] - 1``; a sampler
        that shuffles within a few groups at a time reads each group about once.
        """
        offsets: list[int] = self._group_start.tolist()
        return offsets

    @property
    def targets(self) -> torch.Tensor | None:
        """The target column as one tensor (None without a target).

        This reads the whole target column (only that column) on every access, so keep
        the result rather than asking again.

        Raises:
            DataError: The target column holds nulls or values that are not numbers.
        """
        if self._target is None:
            return None
        self._this_process()
        groups = [self._decode(g, columns=[self._target]) for g in range(len(self._group_file))]
        for g, group in enumerate(groups):
            if group.bad_rows.size:
                sample = self._bad_sample(g, int(group.bad_rows[0]), group)
                raise DataError(
                    f"the targets of the ParquetDataset are unknown for some rows: "
                    f"{sample.describe()}",
                    hint="fix the file, or convert it once with bad_records=skip",
                )
        values = [group.target for group in groups if group.target is not None]
        return torch.from_numpy(np.concatenate(values).astype(self._target_dtype, copy=False))

    def __len__(self) -> int:
        return self._length

    def _decode(self, g: int, *, columns: list[str], reuse: np.ndarray | None = None) -> _Group:
        """Read one row group's ``columns`` and turn them into arrays (no cache).

        ``reuse``: a features array no longer needed (an evicted group's), filled in place
        when its shape fits, so that decoding group after group does not allocate anew.
        """
        pa, _ = require_pyarrow("ParquetDataset")
        file = int(self._group_file[g])
        table = self._handle(file).read_row_group(int(self._group_index[g]), columns=columns)
        rows = table.num_rows
        features = [c for c in columns if c != self._target]
        shape = (rows, len(features))
        out = reuse if reuse is not None and reuse.shape == shape else np.empty(shape, np.float32)
        target = None
        reasons: dict[int, str] = {}
        for name in columns:
            is_target = name == self._target
            dtype = self._target_dtype if is_target else np.float32
            values = _column(pa, table.column(name), dtype, name, reasons)
            if is_target:
                target = values
            else:
                out[:, features.index(name)] = values
        bad_rows = np.asarray(sorted(reasons), dtype=np.int64)
        # Arrow's allocator keeps the freed group's buffers for reuse: ~50 MiB of resident
        # memory on a 1 GB file (benchmarks/memory.py) that the decoded cache already
        # bounds. Hand them back; next to decoding a row group it costs nothing measurable.
        del table
        pa.default_memory_pool().release_unused()
        return _Group(out, target, bad_rows, reasons)

    def _group(self, g: int) -> _Group:
        """A decoded row group, from the cache when it is there."""
        group = self._cache.get(g)
        if group is not None:
            self._cache.move_to_end(g)
            return group
        if not self._cache_size:
            return self._decode(g, columns=self._columns)
        # Evict first and decode into the evicted group's array: never one group more than
        # the cache holds, and no 16 MiB malloc and free per group, which glibc answers by
        # raising its mmap threshold and growing a heap it cannot shrink (~35 MiB on the
        # 1 GB file of benchmarks/memory.py).
        reuse = None
        while len(self._cache) >= self._cache_size:
            reuse = self._cache.popitem(last=False)[1].features
        group = self._cache[g] = self._decode(g, columns=self._columns, reuse=reuse)
        return group

    def _bad_sample(self, g: int, row: int, group: _Group) -> BadSample:
        file = int(self._group_file[g])
        index = int(self._group_start[g]) + row
        in_file = index - int(self._file_start[file])
        return bad_record(
            self._policy,
            source=str(self._files[file]),
            location=f"row {in_file} (dataset index {index})",
            reason=group.reasons[row],
        )

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...] | BadSample:
        return first_sample(self.__getitems__([index]))

    def __getitems__(
        self, indices: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, ...] | FilteredBatch:
        """Read the rows at ``indices`` as one batch, decoding each row group touched once.

        Returns:
            ``(features [B, F] float32, target [B])`` (or ``(features,)``) in the order
            asked; under ``skip`` with bad rows, a :class:`FilteredBatch` of the good
            rows and the bad ones' reasons.
        """
        idx = normalize_indices(indices, self._length)
        self._this_process()
        groups = np.searchsorted(self._group_start, idx, side="right") - 1
        features = np.empty((idx.size, len(self._features)), dtype=np.float32)
        target = np.empty(idx.size, dtype=self._target_dtype) if self._target else None
        order = np.argsort(groups, kind="stable")
        cuts = np.flatnonzero(np.diff(groups[order])) + 1
        parts = np.split(order, cuts) if idx.size else []
        # Groups already decoded first, so decoding the others cannot evict them unused.
        parts.sort(key=lambda part: int(groups[part[0]]) not in self._cache)
        bad: list[tuple[int, BadSample]] = []
        for positions in parts:
            g = int(groups[positions[0]])
            group = self._group(g)
            rows = idx[positions] - self._group_start[g]
            features[positions] = group.features[rows]
            if target is not None:
                assert group.target is not None
                target[positions] = group.target[rows]
            if group.bad_rows.size:
                hit = np.isin(rows, group.bad_rows)
                for p, r in zip(positions[hit], rows[hit], strict=True):
                    bad.append((int(p), self._bad_sample(g, int(r), group)))
        if not bad:
            return as_batch(features, target)
        bad.sort(key=lambda item: item[0])
        keep = np.ones(idx.size, dtype=bool)
        keep[[p for p, _ in bad]] = False
        batch = as_batch(features[keep], None if target is None else target[keep])
        return FilteredBatch(batch if keep.any() else None, [sample for _, sample in bad])

    def __repr__(self) -> str:
        return (
            f"ParquetDataset({self._length} rows in {len(self._files)} file(s), "
            f"{len(self._group_file)} row groups; features {list(self._features)}, "
            f"target {self._target!r})"
        )


def _check_types(
    pa: ModuleType,
    file: Path,
    schema: pa.Schema,
    features: Sequence[str],
    target: str | None,
    *,
    defaulted: bool,
) -> None:
    columns = [*features, *([target] if target is not None else [])]
    kinds = {name: _kind(pa, schema.field(name).type) for name in columns}
    other = [f"{n} ({schema.field(n).type})" for n, k in kinds.items() if k == "other"]
    text = [f"{n} ({schema.field(n).type})" for n in features if kinds[n] == "text"]
    if other or (defaulted and text):
        raise DataError(
            f"Parquet file {file} has column(s) {other or text} that are not numbers; "
            "expected integer, floating-point or boolean feature and target columns.",
            hint="name the numeric feature columns with data.features, or cast the "
            "columns to numbers when writing the file",
        )


def _open(pq: ModuleType, file: Path) -> pq.ParquetFile:
    try:
        # No pre-buffering: it would keep the last row group's raw column chunks (as large
        # as the decoded group) alive until the next read, for no speed-up on local files.
        return pq.ParquetFile(file, pre_buffer=False)
    except (OSError, ValueError) as error:  # pyarrow.ArrowInvalid is a ValueError
        raise DataError(
            f"cannot read {file} as a Parquet file: {error}",
            hint="check that the file is Parquet (not CSV or a partial download)",
        ) from error


def _column(
    pa: ModuleType,
    column: pa.ChunkedArray,
    dtype: type[np.generic],
    name: str,
    reasons: dict[int, str],
) -> np.ndarray:
    """One column as numbers; rows that are null or not numbers go into ``reasons``."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if column.null_count:
        for row in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)):
            reasons.setdefault(int(row), f"column {name!r} is null")
    if _kind(pa, column.type) == "text":
        return _parse_text(column, dtype, name, reasons)
    if pa.types.is_decimal(column.type):
        column = column.cast(pa.float64())
    if column.null_count:
        column = column.fill_null(False if pa.types.is_boolean(column.type) else 0)
    return _numbers(pa, column).astype(dtype, copy=False)


def _numbers(pa: Any, column: pa.ChunkedArray) -> np.ndarray:
    """A null-free numeric or boolean column as one numpy array, read from its buffers.

    ``to_numpy`` imports pandas when it is installed (pyarrow asks it about the column's
    type), and pandas imports ``pyarrow.compute``: tens of MiB of resident memory for a
    table of plain numbers. So each chunk's data buffer is read directly: integers and
    floats in place (``np.frombuffer``, no copy; read-only when there is one chunk, as
    ``to_numpy`` gives it), booleans (one bit a value) unpacked; the chunks joined. Other
    types, and a column with no rows, go through ``to_numpy``.
    """
    kind = column.type
    chunks = [chunk for chunk in column.chunks if len(chunk)]
    if pa.types.is_boolean(kind):
        parts = [_bits(chunk) for chunk in chunks]
    elif pa.types.is_floating(kind) or pa.types.is_integer(kind):
        if pa.types.is_floating(kind):
            letter = "f"
        else:
            letter = "u" if pa.types.is_unsigned_integer(kind) else "i"
        dtype = np.dtype(f"{letter}{kind.bit_width // 8}")
        parts = [_fixed_width(chunk, dtype) for chunk in chunks]
    else:
        parts = []
    if not parts:
        array: np.ndarray = column.to_numpy()
        return array
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _fixed_width(chunk: Any, dtype: np.dtype) -> np.ndarray:
    """One chunk of fixed-width numbers, in place."""
    offset = chunk.offset * dtype.itemsize
    return np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=offset)


def _bits(chunk: Any) -> np.ndarray:
    """One chunk of booleans, unpacked from Arrow's bitmap (least significant bit first)."""
    bits = np.unpackbits(np.frombuffer(chunk.buffers()[1], dtype=np.uint8), bitorder="little")
    return bits[chunk.offset : chunk.offset + len(chunk)].view(np.bool_)


def _parse_text(
    column: pa.ChunkedArray, dtype: type[np.generic], name: str, reasons: dict[int, str]
) -> np.ndarray:
    """Numbers written as strings; a string that is not one is a bad row."""
    out = np.zeros(len(column), dtype=dtype)
    for row, value in enumerate(column.to_pylist()):
        if value is None:
            continue
        try:
            out[row] = float(value)
        except ValueError:
            reasons.setdefault(row, f"column {name!r} value {value!r} is not a number")
    return out
