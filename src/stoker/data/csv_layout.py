"""A CSV file's header, columns and rows parsed to numbers: numpy only, no torch.

Split from :mod:`stoker.data.tabular` so that ``stoker data inspect`` reads a CSV file
exactly as :class:`~stoker.data.tabular.CsvDataset` does without importing torch.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from stoker.data.records import BadRecordPolicy, BadSample, bad_record
from stoker.errors import ConfigError, DataError

TargetDtype = Literal["auto", "int64", "float32"]

# Lines read to decide the target dtype under target_dtype="auto".
_SNIFF_LINES = 1000


def check_policy(bad_records: Any, what: str) -> None:
    """Raise ConfigError unless ``bad_records`` is ``error`` or ``skip``."""
    if bad_records not in ("error", "skip"):
        raise ConfigError(
            f"{what} bad_records={bad_records!r}; expected 'error' or 'skip'.",
            hint="set data.bad_records=error (stop at the first bad record) or skip",
        )


def resolve_columns(
    columns: Sequence[str],
    *,
    features: Sequence[str] | None,
    target: str | None,
    source: str,
) -> tuple[tuple[str, ...], str | None]:
    """The feature columns (default: every column but the target) and the target column.

    Raises:
        DataError: A named column that ``source`` does not have, or no feature columns.
    """
    if isinstance(features, str):
        features = [features]
    wanted = [*(features or ()), *([target] if target is not None else [])]
    missing = [name for name in wanted if name not in columns]
    if missing:
        raise DataError(
            f"{source} has no column(s) {missing}; its columns are {list(columns)}.",
            hint="set data.features / data.target to columns the file has",
        )
    chosen = tuple(features) if features is not None else tuple(c for c in columns if c != target)
    if not chosen:
        raise DataError(
            f"{source} leaves no feature columns (columns {list(columns)}, target {target!r}).",
            hint="name the feature columns with data.features",
        )
    if target is not None and target in chosen:
        raise DataError(
            f"column {target!r} of {source} is both a feature and the target.",
            hint="leave the target out of data.features",
        )
    return chosen, target


def _split(text: str, delimiter: str) -> list[str]:
    # The csv module is needed only for quoted fields; plain split is several times faster.
    if '"' in text:
        return next(csv.reader([text], delimiter=delimiter), [])
    return text.split(delimiter)


def _parse_column(
    values: list[str], dtype: type[np.generic], name: str
) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """Numbers from one column's strings, with ``(position, reason)`` for each that is not one."""
    try:
        if dtype is np.int64:
            text = np.array(values, dtype=str)
            try:
                return text.astype(np.int64), []
            except ValueError:  # whole floats ("3.0") are labels too, see _integer
                numbers = text.astype(np.float64)
                if np.all(np.isfinite(numbers) & (numbers == np.round(numbers))):
                    return numbers.astype(np.int64), []
                raise
        # Through float64, as Python's float() rounds, so both paths give the same values.
        return np.array(values, dtype=str).astype(np.float64).astype(dtype), []
    except (ValueError, OverflowError):
        pass
    out = np.zeros(len(values), dtype=dtype)
    problems = []
    for position, value in enumerate(values):
        try:
            out[position] = _integer(value) if dtype is np.int64 else float(value)
        except (ValueError, OverflowError):
            if not value.strip():
                reason = f"column {name!r} is empty"
            else:
                kind = "an integer" if dtype is np.int64 else "a number"
                reason = f"column {name!r} value {value!r} is not {kind}"
            problems.append((position, reason))
    return out, problems


def _integer(value: str) -> int:
    """An integer label, written as one (``3``) or as a whole float (``3.0``, as pandas
    writes an integer column that had a missing value); ``3.5`` is refused."""
    try:
        return int(value)
    except ValueError:
        number = float(value)
        if not number.is_integer():
            raise
        return int(number)


@dataclass(frozen=True)
class _Layout:
    """Which columns of a CSV file are read, and as what."""

    source: str
    columns: tuple[str, ...]
    feature_cols: tuple[int, ...]
    target_col: int | None
    delimiter: str
    target_dtype: type[np.generic] | None
    header_bytes: int

    @property
    def feature_names(self) -> tuple[str, ...]:
        return tuple(self.columns[i] for i in self.feature_cols)

    @property
    def target_name(self) -> str | None:
        return None if self.target_col is None else self.columns[self.target_col]


def _layout(
    path: Path,
    *,
    features: Sequence[str] | None,
    target: str | None,
    delimiter: str,
    target_dtype: TargetDtype,
) -> _Layout:
    """Read the header and check the options; the target dtype under ``auto`` is sniffed later."""
    if not isinstance(delimiter, str) or len(delimiter) != 1:
        raise ConfigError(
            f"CSV delimiter={delimiter!r}; expected one character.",
            hint="use e.g. delimiter=',' or delimiter='\\t'",
        )
    if target_dtype not in ("auto", "int64", "float32"):
        raise ConfigError(
            f"CSV target_dtype={target_dtype!r}; expected 'auto', 'int64' or 'float32'.",
            hint="use target_dtype='int64' for class labels, 'float32' for regression",
        )
    if not path.is_file():
        raise DataError(
            f"CSV file {path.absolute()} does not exist.",
            hint="check the path: in a run config a relative path is taken from the config "
            "file's folder, in stoker.fit from the working directory",
        )
    with path.open("rb") as stream:
        header = stream.readline()
    text = header.decode("utf-8-sig", errors="replace").rstrip("\r\n")
    if not text.strip():
        raise DataError(
            f"CSV file {path} has no header row (its first line is empty); expected column "
            "names on the first line.",
            hint="add a header line such as `x1,x2,label`",
        )
    columns = tuple(name.strip() for name in _split(text, delimiter))
    if len(set(columns)) != len(columns):
        raise DataError(f"CSV file {path} has duplicate column names in its header: {columns}.")
    chosen, target = resolve_columns(columns, features=features, target=target, source=str(path))
    dtype = {"int64": np.int64, "float32": np.float32}.get(target_dtype)
    return _Layout(
        source=str(path),
        columns=columns,
        feature_cols=tuple(columns.index(c) for c in chosen),
        target_col=None if target is None else columns.index(target),
        delimiter=delimiter,
        target_dtype=dtype if target is not None else None,
        header_bytes=len(header),
    )


def _sniff_target_dtype(path: Path, layout: _Layout) -> _Layout:
    """Under ``auto``: int64 if the target of the first rows is always an integer, else float32."""
    if layout.target_col is None or layout.target_dtype is not None:
        return layout
    integers = True
    with path.open("rb") as stream:
        stream.readline()
        for _, raw in zip(range(_SNIFF_LINES), stream, strict=False):
            fields = _split(raw.decode("utf-8", errors="replace").rstrip("\r\n"), layout.delimiter)
            # Rows that are bad anyway (wrong width, empty target) do not decide the dtype.
            if len(fields) != len(layout.columns) or not fields[layout.target_col].strip():
                continue
            try:
                int(fields[layout.target_col])
            except ValueError:
                integers = False
                break
    return dataclasses.replace(layout, target_dtype=np.int64 if integers else np.float32)


@dataclass(frozen=True)
class _Parsed:
    features: np.ndarray
    target: np.ndarray | None
    kept: np.ndarray  # positions (in the lines given) of the rows parsed
    bad: list[BadSample]


def _parse_lines(
    lines: Sequence[bytes], line_numbers: Sequence[int], layout: _Layout, policy: BadRecordPolicy
) -> _Parsed:
    """Parse data lines; a bad one raises under ``error`` and is left out under ``skip``."""
    width = len(layout.columns)
    rows: list[list[str]] = []
    positions: list[int] = []
    reasons: dict[int, str] = {}
    for position, raw in enumerate(lines):
        fields = _split(raw.decode("utf-8", errors="replace").rstrip("\r\n"), layout.delimiter)
        if len(fields) == width:
            rows.append(fields)
            positions.append(position)
        else:
            reasons[position] = f"expected {width} fields as in the header, got {len(fields)}"
    features = np.empty((len(rows), len(layout.feature_cols)), dtype=np.float32)
    parts = [(j, col, np.float32) for j, col in enumerate(layout.feature_cols)]
    if layout.target_col is not None:
        assert layout.target_dtype is not None
        parts.append((-1, layout.target_col, layout.target_dtype))
    target = None
    for j, col, dtype in parts:
        values, problems = _parse_column([r[col] for r in rows], dtype, layout.columns[col])
        if j >= 0:
            features[:, j] = values
        else:
            target = values
        for row, reason in problems:
            reasons.setdefault(positions[row], reason)
    bad = [
        bad_record(
            policy, source=layout.source, location=f"line {line_numbers[p]}", reason=reasons[p]
        )
        for p in sorted(reasons)
    ]
    kept = np.asarray(positions, dtype=np.int64)
    if bad:
        good = np.array([p not in reasons for p in positions], dtype=bool)
        kept, features = kept[good], features[good]
        target = None if target is None else target[good]
    return _Parsed(features, target, kept, bad)
