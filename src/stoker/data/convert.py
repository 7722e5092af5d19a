"""convert_csv(): stream a CSV file into Parquet or .npy files, with a report of every row."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

import numpy as np

from stoker.data.csv_layout import check_policy
from stoker.data.parquet import require_pyarrow
from stoker.data.records import BadRecordPolicy, BadSample
from stoker.data.tabular import CsvChunk, TargetDtype, iter_csv_chunks
from stoker.errors import ConfigError, DataError

__all__ = ["ConversionReport", "ConvertFormat", "convert_csv"]

logger = logging.getLogger("stoker")

ConvertFormat = Literal["parquet", "npy"]
_PARTIAL = ".partial"


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert_csv` wrote and what it left out.

    Attributes:
        source: The CSV file.
        format: ``parquet`` or ``npy``.
        outputs: The files written.
        rows_written: Rows in the output.
        rows_skipped: Bad rows left out (under ``bad_records="skip"``).
        skipped: Each left-out row with its file, line and reason.
        bytes_written: Total size of the outputs.
        feature_names: The feature columns, in output order.
        target_name: The target column, or None.
    """

    source: Path
    format: ConvertFormat
    outputs: tuple[Path, ...]
    rows_written: int
    rows_skipped: int
    skipped: tuple[BadSample, ...]
    bytes_written: int
    feature_names: tuple[str, ...]
    target_name: str | None

    def summary(self) -> str:
        """A few lines for a person: counts, outputs and the first skipped rows."""
        lines = [
            f"converted {self.source} to {self.format}: {self.rows_written} rows written, "
            f"{self.rows_skipped} skipped, {self.bytes_written / 2**20:.1f} MiB",
            *(f"  wrote {path}" for path in self.outputs),
            *(f"  skipped {sample.describe()}" for sample in self.skipped[:10]),
        ]
        if self.rows_skipped > 10:
            lines.append(f"  ... and {self.rows_skipped - 10} more skipped rows")
        return "\n".join(lines)


def convert_csv(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: ConvertFormat,
    features: Sequence[str] | None = None,
    target: str | None = None,
    chunk_rows: int = 65536,
    bad_records: BadRecordPolicy = "error",
    delimiter: str = ",",
    target_dtype: TargetDtype = "auto",
    overwrite: bool = False,
) -> ConversionReport:
    """Convert a CSV file once, so that every epoch reads Parquet or .npy instead of text.

    Reads ``chunk_rows`` lines at a time, so memory stays bounded by one chunk
    whatever the file size. Outputs are written under a ``.partial`` name and renamed
    at the end; a failed conversion leaves nothing behind.

    Args:
        src: The CSV file, with a header row.
        dst: ``parquet``: the output file (row groups of ``chunk_rows`` rows; feature
            columns float32, the target int64 or float32). ``npy``: a folder that gets
            ``features.npy`` ``[rows, features]`` float32 and ``target.npy`` ``[rows]``,
            ready for :class:`~stoker.data.memmap.NpyDataset`.
        to: ``parquet`` or ``npy``.
        features: Feature columns (default: every column but the target).
        target: The target column, or None.
        chunk_rows: CSV lines per chunk (and per Parquet row group).
        bad_records: ``error`` stops at the first bad row; ``skip`` leaves it out and
            lists it in the report.
        delimiter: The CSV field separator, one character.
        target_dtype: ``int64``, ``float32`` or ``auto`` (int64 if the target of the first
            1000 rows is always an integer).
        overwrite: Replace outputs that exist.

    Returns:
        The report: rows written and skipped (with reasons), output paths and bytes.

    Raises:
        ConfigError: Invalid options, pyarrow missing for Parquet.
        DataError: A missing or malformed CSV file, outputs that exist without
            ``overwrite``, or no rows left to write.
        BadRecordError: A bad row under ``bad_records="error"``.
    """
    if to not in ("parquet", "npy"):
        raise ConfigError(
            f"convert_csv to={to!r}; expected 'parquet' or 'npy'.",
            hint="use to='parquet' (compact, typed) or to='npy' (fastest random access)",
        )
    check_policy(bad_records, "convert_csv")
    source, dest = Path(src), Path(dst)
    chunks = iter_csv_chunks(
        source,
        chunk_rows=chunk_rows,
        features=features,
        target=target,
        delimiter=delimiter,
        bad_records=bad_records,
        target_dtype=target_dtype,
    )
    if to == "parquet":
        outputs, written, skipped, names = _to_parquet(chunks, source, dest, chunk_rows, overwrite)
    else:
        outputs, written, skipped, names = _to_npy(chunks, source, dest, overwrite)
    report = ConversionReport(
        source=source,
        format=to,
        outputs=outputs,
        rows_written=written,
        rows_skipped=len(skipped),
        skipped=tuple(skipped),
        bytes_written=sum(path.stat().st_size for path in outputs),
        feature_names=names[0],
        target_name=names[1],
    )
    if skipped:
        logger.warning(
            "convert_csv skipped %d bad row(s) of %s; the first: %s",
            len(skipped),
            source,
            skipped[0].describe(),
        )
    return report


_Result = tuple[tuple[Path, ...], int, list[BadSample], tuple[tuple[str, ...], str | None]]


def _check_free(paths: Sequence[Path], overwrite: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not overwrite:
        raise DataError(
            f"convert_csv would overwrite {existing}.",
            hint="choose another destination, delete the files, or pass overwrite=True",
        )


def _nothing_written(skipped: list[BadSample], source: Path) -> DataError:
    first = f"; the first skipped: {skipped[0].describe()}" if skipped else ""
    return DataError(
        f"convert_csv found no rows to write in {source} ({len(skipped)} skipped{first}).",
        hint="check the file has data rows below its header, and the skipped rows' reasons",
    )


def _to_parquet(
    chunks: Iterator[CsvChunk], source: Path, dest: Path, chunk_rows: int, overwrite: bool
) -> _Result:
    pa, pq = require_pyarrow("convert_csv(to='parquet')")
    _check_free([dest], overwrite)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + _PARTIAL)
    writer = None
    written = 0
    skipped: list[BadSample] = []
    names: tuple[tuple[str, ...], str | None] = ((), None)
    try:
        for chunk in chunks:
            skipped.extend(chunk.bad)
            names = (chunk.feature_names, chunk.target_name)
            if not len(chunk.features):
                continue
            table = _table(pa, chunk)
            if writer is None:
                writer = pq.ParquetWriter(partial, table.schema)
            writer.write_table(table, row_group_size=chunk_rows)
            written += table.num_rows
        if writer is None:
            raise _nothing_written(skipped, source)
        writer.close()
        os.replace(partial, dest)
    except BaseException:
        if writer is not None:
            writer.close()
        partial.unlink(missing_ok=True)
        raise
    return (dest,), written, skipped, names


def _table(pa: ModuleType, chunk: CsvChunk) -> Any:
    """One chunk as an Arrow table: a float32 column per feature, then the target."""
    columns = {
        name: pa.array(np.ascontiguousarray(chunk.features[:, j]))
        for j, name in enumerate(chunk.feature_names)
    }
    if chunk.target_name is not None and chunk.target is not None:
        columns[chunk.target_name] = pa.array(chunk.target)
    return pa.table(columns)


class _NpyWriter:
    """Appends rows to a .npy file made by ``open_memmap``, through plain file writes."""

    def __init__(self, path: Path, dtype: type[np.generic], shape: tuple[int, ...]) -> None:
        self.path = path
        self.shape = shape
        self.dtype = np.dtype(dtype)
        # open_memmap writes the header and sizes the file; rows are then written
        # through the file, so written pages do not pile up in this process's RSS.
        array = np.lib.format.open_memmap(path, mode="w+", dtype=self.dtype, shape=shape)
        self.offset = array.offset
        del array
        self.stream = path.open("r+b")
        self.stream.seek(self.offset)
        self.rows = 0

    def write(self, rows: np.ndarray) -> None:
        if self.rows + len(rows) > self.shape[0]:
            raise DataError(
                f"the CSV file grew while it was converted ({self.path} was sized for "
                f"{self.shape[0]} rows).",
                hint="convert a file that nothing is writing to",
            )
        self.stream.write(np.ascontiguousarray(rows, dtype=self.dtype).tobytes())
        self.rows += len(rows)

    def finish(self, final: Path) -> None:
        """Move the rows into ``final``; copied into an exact-size file if rows were skipped."""
        self.stream.close()
        if self.rows == self.shape[0]:
            os.replace(self.path, final)
            return
        shape = (self.rows, *self.shape[1:])
        exact = _NpyWriter(final.with_name(final.name + _PARTIAL + "2"), self.dtype.type, shape)
        remaining = self.rows * int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize
        with self.path.open("rb") as source:
            source.seek(self.offset)
            while remaining:
                block = source.read(min(remaining, 16 << 20))
                exact.stream.write(block)
                remaining -= len(block)
        exact.stream.close()
        os.replace(exact.path, final)
        self.path.unlink()

    def discard(self) -> None:
        self.stream.close()
        self.path.unlink(missing_ok=True)


def _to_npy(chunks: Iterator[CsvChunk], source: Path, dest: Path, overwrite: bool) -> _Result:
    first = next(chunks, None)
    if first is None:
        raise _nothing_written([], source)
    has_target = first.target is not None
    finals = [dest / "features.npy", *([dest / "target.npy"] if has_target else [])]
    _check_free(finals, overwrite)
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    # A streaming count first, so the arrays are made at their size up front.
    rows = _count_rows(source)
    width = len(first.feature_names)
    partials = [final.with_name(final.name + _PARTIAL) for final in finals]
    writers = [_NpyWriter(partials[0], np.float32, (rows, width))]
    if first.target is not None:
        writers.append(_NpyWriter(partials[1], first.target.dtype.type, (rows,)))
    skipped: list[BadSample] = []
    try:
        for chunk in _chain(first, chunks):
            skipped.extend(chunk.bad)
            writers[0].write(chunk.features)
            if chunk.target is not None:
                writers[1].write(chunk.target)
        if writers[0].rows == 0:
            raise _nothing_written(skipped, source)
        for writer, final in zip(writers, finals, strict=True):
            writer.finish(final)
    except BaseException:
        for writer in writers:
            writer.discard()
        if created and not any(dest.iterdir()):
            dest.rmdir()
        raise
    names = (first.feature_names, first.target_name)
    return tuple(finals), writers[0].rows, skipped, names


def _count_rows(path: Path) -> int:
    """Data rows of a CSV file (non-blank lines after the header), in one streaming pass."""
    with path.open("rb") as stream:
        stream.readline()
        return sum(1 for raw in stream if raw not in (b"\n", b"\r\n"))


def _chain(first: CsvChunk, rest: Iterator[CsvChunk]) -> Iterator[CsvChunk]:
    yield first
    yield from rest
