"""CSV sources: a map-style CsvDataset over a byte-offset line index, and chunked reading."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stoker.data.csv_layout import (
    TargetDtype,
    _Layout,
    _layout,
    _parse_lines,
    _Parsed,
    _sniff_target_dtype,
    check_policy,
)
from stoker.data.memmap import normalize_indices
from stoker.data.records import BadRecordPolicy, BadSample, FilteredBatch, first_sample
from stoker.errors import ConfigError, DataError

__all__ = ["CsvChunk", "CsvDataset", "TargetDtype", "iter_csv_chunks"]

# Bytes read per step while indexing line starts (the whole file is never held).
_INDEX_CHUNK_BYTES = 16 << 20
# Wanted lines closer than this are read in one go (one system call instead of several).
_READ_GAP_BYTES = 16 << 10
_BLANK = (b"\n", b"\r\n")


def as_batch(features: np.ndarray, target: np.ndarray | None) -> tuple[torch.Tensor, ...]:
    """``(features, target)`` as tensors, or ``(features,)`` without a target."""
    if target is None:
        return (torch.from_numpy(features),)
    return torch.from_numpy(features), torch.from_numpy(target)


class CsvDataset(Dataset[Any]):
    """Rows of a CSV file as samples ``(features, target)``, read a batch at a time.

    On first use (``len()`` or a fetch) one streaming pass records where every line
    starts (8 bytes per line; the file is read in 16 MiB steps, never whole). A fetch
    then sorts the wanted rows, reads just their lines (nearby lines in one read) and
    parses them. The first line is the header; blank lines are not samples. One record
    per line: quoted fields may hold the delimiter but not a line break.

    Parsing text costs every epoch: for repeated epochs, convert once with
    :func:`stoker.data.convert.convert_csv` to Parquet or .npy and read that instead.

    A row with the wrong number of fields or a value that is not a number is a bad
    record: under ``bad_records="error"`` it raises :class:`BadRecordError` naming the
    file, ``line N`` (1-based, the header is line 1), the column and the value; under
    ``"skip"`` the batch comes back as a :class:`FilteredBatch` without it.
    """

    #: ``__getitems__`` returns one collated batch, not a list of samples.
    returns_batches = True

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        features: Sequence[str] | None = None,
        target: str | None = None,
        delimiter: str = ",",
        bad_records: BadRecordPolicy = "error",
        target_dtype: TargetDtype = "auto",
    ) -> None:
        """Read the header and check the columns; the line index is built on first use.

        Args:
            path: The CSV file, with a header row.
            features: Feature columns, in sample order (default: every column but the target).
            target: The target column; None gives samples ``(features,)``.
            delimiter: The field separator, one character.
            bad_records: ``error`` raises at a bad row; ``skip`` leaves it out of the batch.
            target_dtype: ``int64`` (class labels), ``float32`` (regression) or ``auto``:
                int64 if the target of the first 1000 rows is always an integer.

        Raises:
            DataError: A missing file, no header, or a named column the header lacks.
            ConfigError: An invalid delimiter, ``bad_records`` or ``target_dtype``.
        """
        check_policy(bad_records, "CsvDataset")
        self._path = Path(path)
        self._layout = _layout(
            self._path,
            features=features,
            target=target,
            delimiter=delimiter,
            target_dtype=target_dtype,
        )
        self._policy: BadRecordPolicy = bad_records
        self._bounds: np.ndarray | None = None  # line i spans bounds[i]:bounds[i + 1]
        self._rows: np.ndarray | None = None  # line of each row when blank lines exist
        self._size = -1

    @property
    def path(self) -> Path:
        """The CSV file read."""
        return self._path

    @property
    def columns(self) -> tuple[str, ...]:
        """Every column named in the header."""
        return self._layout.columns

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The feature columns, in the order of the features tensor."""
        return self._layout.feature_names

    @property
    def target_name(self) -> str | None:
        """The target column; None when samples are features alone."""
        return self._layout.target_name

    def _index(self) -> np.ndarray:
        """Build (once) the line bounds by scanning the file for newlines."""
        if self._bounds is not None:
            return self._bounds
        self._layout = _sniff_target_dtype(self._path, self._layout)
        starts = [np.array([self._layout.header_bytes], dtype=np.int64)]
        blanks = []
        with self._path.open("rb") as stream:
            stream.seek(self._layout.header_bytes)
            offset = self._layout.header_bytes
            line_start = offset  # start of the line the next newline ends
            previous_byte = -1
            while chunk := stream.read(_INDEX_CHUNK_BYTES):
                data = np.frombuffer(chunk, dtype=np.uint8)
                newlines = np.flatnonzero(data == 10)
                if newlines.size:
                    line_starts = np.concatenate(([line_start - offset], newlines[:-1] + 1))
                    length = newlines - line_starts
                    before = np.where(newlines > 0, data[newlines - 1], previous_byte)
                    blank = (length == 0) | ((length == 1) & (before == 13))
                    starts.append(newlines.astype(np.int64) + offset + 1)
                    blanks.append(blank)
                    line_start = int(newlines[-1]) + offset + 1
                previous_byte = int(data[-1])
                offset += len(chunk)
        bounds = np.concatenate(starts)
        if bounds[-1] != offset:  # the last line has no newline
            bounds = np.append(bounds, offset)
        blank = np.concatenate(blanks) if blanks else np.zeros(0, dtype=bool)
        blank = np.concatenate((blank, np.zeros(len(bounds) - 1 - len(blank), dtype=bool)))
        self._rows = np.flatnonzero(~blank) if blank.any() else None
        self._size = offset
        self._bounds = bounds
        return bounds

    def __len__(self) -> int:
        bounds = self._index()
        return len(bounds) - 1 if self._rows is None else len(self._rows)

    def _read(self, lines: np.ndarray) -> list[bytes]:
        """The bytes of the given lines (sorted), nearby ones read together."""
        bounds = self._index()
        starts, stops = bounds[lines], bounds[lines + 1]
        breaks = np.flatnonzero(starts[1:] - stops[:-1] > _READ_GAP_BYTES) + 1
        out: list[bytes] = []
        # A fresh descriptor per fetch: nothing shared with forked workers, nothing to close.
        with self._path.open("rb", buffering=0) as stream:
            fd = stream.fileno()
            if os.fstat(fd).st_size != self._size:
                raise DataError(
                    f"CSV file {self._path} changed size since it was indexed "
                    f"({self._size} bytes then, {os.fstat(fd).st_size} now).",
                    hint="do not write to a file while training reads it; restart the run",
                )
            for segment in np.split(np.arange(len(lines)), breaks):
                low, high = int(starts[segment[0]]), int(stops[segment].max())
                buffer = os.pread(fd, high - low, low)
                out.extend(buffer[starts[k] - low : stops[k] - low] for k in segment)
        return out

    def _fetch(self, idx: np.ndarray) -> _Parsed:
        """Parse the rows at ``idx`` (sorted); line numbers count the header as line 1."""
        lines = idx if self._rows is None else self._rows[idx]
        return _parse_lines(self._read(lines), (lines + 2).tolist(), self._layout, self._policy)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...] | BadSample:
        return first_sample(self.__getitems__([index]))

    def __getitems__(
        self, indices: Sequence[int] | torch.Tensor
    ) -> tuple[torch.Tensor, ...] | FilteredBatch:
        """Read and parse the rows at ``indices`` as one batch.

        Returns:
            ``(features [B, F] float32, target [B])`` (or ``(features,)``) in the order
            asked; under ``skip`` with bad rows, a :class:`FilteredBatch` of the good
            rows and the bad ones' reasons.
        """
        idx = normalize_indices(indices, len(self))
        order = np.argsort(idx, kind="stable")
        parsed = self._fetch(idx[order])
        # Back to the order asked: position p of the sorted read was request order[p].
        back = np.argsort(order[parsed.kept], kind="stable")
        target = None if parsed.target is None else parsed.target[back]
        batch = as_batch(parsed.features[back], target)
        if parsed.bad:
            return FilteredBatch(batch if len(back) else None, parsed.bad)
        return batch

    def __repr__(self) -> str:
        rows = "unindexed" if self._bounds is None else f"{len(self)} rows"
        return (
            f"CsvDataset({self._path}; {rows}; features {list(self.feature_names)}, "
            f"target {self.target_name!r})"
        )


@dataclass(frozen=True)
class CsvChunk:
    """Up to ``chunk_rows`` parsed rows of a CSV file.

    Attributes:
        features: ``[rows, features]`` float32, one column per feature column.
        target: ``[rows]`` int64 or float32, or None without a target column.
        feature_names: The feature columns, in order.
        target_name: The target column, or None.
        bad: The rows left out under ``skip``, with file, line and reason.
    """

    features: np.ndarray
    target: np.ndarray | None
    feature_names: tuple[str, ...]
    target_name: str | None
    bad: tuple[BadSample, ...]


def iter_csv_chunks(
    path: str | os.PathLike[str],
    *,
    chunk_rows: int = 65536,
    features: Sequence[str] | None = None,
    target: str | None = None,
    delimiter: str = ",",
    bad_records: BadRecordPolicy = "error",
    target_dtype: TargetDtype = "auto",
) -> Iterator[CsvChunk]:
    """Read a CSV file front to back in chunks of parsed rows, with bounded memory.

    Args:
        path: The CSV file, with a header row.
        chunk_rows: Data lines per chunk (a chunk holds fewer rows if some were bad).
        features: Feature columns (default: every column but the target).
        target: The target column, or None.
        delimiter: The field separator, one character.
        bad_records: ``error`` raises at the first bad row; ``skip`` lists it in the chunk.
        target_dtype: As for :class:`CsvDataset`.

    Returns:
        An iterator of :class:`CsvChunk`.

    Raises:
        DataError: A missing file, no header, or a named column the header lacks.
        ConfigError: Invalid options.
    """
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ConfigError(
            f"chunk_rows must be an int >= 1; got {chunk_rows!r}.", hint="use chunk_rows=65536"
        )
    check_policy(bad_records, "iter_csv_chunks")
    source = Path(path)
    layout = _layout(
        source, features=features, target=target, delimiter=delimiter, target_dtype=target_dtype
    )
    return _chunks(source, _sniff_target_dtype(source, layout), chunk_rows, bad_records)


def _chunks(
    path: Path, layout: _Layout, chunk_rows: int, policy: BadRecordPolicy
) -> Iterator[CsvChunk]:
    def chunk(lines: list[bytes], numbers: list[int]) -> CsvChunk:
        parsed = _parse_lines(lines, numbers, layout, policy)
        return CsvChunk(
            parsed.features,
            parsed.target,
            layout.feature_names,
            layout.target_name,
            tuple(parsed.bad),
        )

    with path.open("rb") as stream:
        stream.readline()
        lines: list[bytes] = []
        numbers: list[int] = []
        for number, raw in enumerate(stream, start=2):
            if raw in _BLANK:
                continue
            lines.append(raw)
            numbers.append(number)
            if len(lines) == chunk_rows:
                yield chunk(lines, numbers)
                lines, numbers = [], []
        if lines:
            yield chunk(lines, numbers)
