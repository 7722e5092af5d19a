"""Prediction files: rows written batch by batch to .parquet, .csv or .npy, atomically.

``stoker predict`` (:func:`stoker.inference.predict`) feeds a writer one batch of model
outputs at a time, so memory stays one batch (plus a Parquet row group) whatever the
data's size. The file is written beside its final name and renamed into place when
complete: an interrupted prediction leaves no half file under that name.
"""

from __future__ import annotations

import contextlib
import csv
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from stoker.checkpoint.io import _umask, fsync_dir, os_error
from stoker.errors import ConfigError, DataError

__all__ = ["CsvWriter", "NpyWriter", "ParquetWriter", "PredictionWriter", "open_writer"]

_ROW_GROUP = 65_536  # rows buffered per Parquet row group


class PredictionWriter:
    """Turns each batch of outputs into rows and writes them; a context manager.

    Subclasses write the rows (``_write_columns``) or the raw outputs (``.npy``).
    """

    suffix = ""

    def __init__(
        self,
        path: Path,
        *,
        task: str | None,
        classes: Sequence[str] | None = None,
        rows: int | None = None,
    ) -> None:
        self.path = path
        self.task = task
        self.classes = list(classes) if classes is not None else None
        self.expected_rows = rows
        self.rows = 0
        self.tmp: Path = path

    def __enter__(self) -> PredictionWriter:
        if not self.path.parent.is_dir():
            raise DataError(
                f"cannot write {self.path}: the folder {self.path.parent} does not exist",
                hint=f"create it first (mkdir -p {self.path.parent})",
            )
        try:
            fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=self.suffix, dir=self.path.parent)
        except OSError as exc:
            raise os_error(self.path, "predictions file", exc) from exc
        # mkstemp makes 0600 files; predictions get the mode any other new file gets.
        if os.chmod in os.supports_fd:
            os.fchmod(fd, 0o666 & ~_umask())
        os.close(fd)
        self.tmp = Path(name)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if exc is not None:
                self._abandon()
                return
            self._finish()
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        finally:
            with contextlib.suppress(OSError):
                self.tmp.unlink(missing_ok=True)  # gone already when renamed

    def write(self, outputs: Any, targets: Any = None) -> None:
        """Adds one batch: the model's outputs and, when the data has them, the targets."""
        if not isinstance(outputs, torch.Tensor):
            raise DataError(
                f"the model returned a {type(outputs).__name__}, not a tensor; predictions "
                "need one output tensor per batch",
                hint="load the model with stoker.load_model(run_dir) and run it yourself",
            )
        out = outputs.detach().float().cpu()  # a CPU-GPU sync per batch: the rows go to disk
        self._write_outputs(out, targets)
        self.rows += out.shape[0] if out.ndim else 1

    def _write_outputs(self, outputs: torch.Tensor, targets: Any) -> None:
        columns = self._columns(outputs, targets)
        self._write_columns(columns)

    def _columns(self, outputs: torch.Tensor, targets: Any) -> dict[str, np.ndarray]:
        """The table rows of one batch, as named columns."""
        count = outputs.shape[0]
        columns: dict[str, np.ndarray] = {
            "index": np.arange(self.rows, self.rows + count, dtype=np.int64)
        }
        if self.task == "classification" and outputs.ndim == 2:
            if outputs.shape[1] == 1:  # one logit: a binary classifier (bce_with_logits)
                probability = torch.sigmoid(outputs[:, 0])
                prediction = (probability > 0.5).long()
                probability = torch.where(prediction == 1, probability, 1 - probability)
            else:
                probability, prediction = torch.softmax(outputs, dim=1).max(dim=1)
            columns["prediction"] = prediction.numpy()
            columns["probability"] = probability.numpy()
            if self.classes is not None:
                names = np.asarray(self.classes, dtype=object)
                columns["label"] = names[prediction.numpy()]
        elif outputs.ndim == 1 or (outputs.ndim == 2 and outputs.shape[1] == 1):
            columns["prediction"] = outputs.reshape(count).numpy()
        elif outputs.ndim == 2:
            for k in range(outputs.shape[1]):
                columns[f"prediction_{k}"] = outputs[:, k].numpy()
        else:
            raise DataError(
                f"the model's outputs have shape {list(outputs.shape)}; a table holds one "
                f"row per sample, so {self.suffix} takes outputs of shape [N] or [N, K]",
                hint=f"write them as .npy instead ({self.path.with_suffix('.npy')})",
            )
        if isinstance(targets, torch.Tensor) and targets.ndim == 1 and len(targets) == count:
            columns["target"] = targets.detach().cpu().numpy()
        return columns

    def _write_columns(self, columns: dict[str, np.ndarray]) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        """Completes the file (before it is renamed into place)."""

    def _abandon(self) -> None:
        """Closes what is open after a failure; the temporary file is then removed."""
        self._finish()


class CsvWriter(PredictionWriter):
    """One CSV row per sample, the header first."""

    suffix = ".csv"

    def __enter__(self) -> CsvWriter:
        super().__enter__()
        self._file = open(self.tmp, "w", newline="")  # closed in _finish
        self._csv = csv.writer(self._file)
        self._header: list[str] | None = None
        return self

    def _write_columns(self, columns: dict[str, np.ndarray]) -> None:
        if self._header is None:
            self._header = list(columns)
            self._csv.writerow(self._header)
        values = [columns[name].tolist() for name in self._header]
        self._csv.writerows(zip(*values, strict=True))

    def _finish(self) -> None:
        self._file.close()


class ParquetWriter(PredictionWriter):
    """A Parquet file, one row group per ~65k rows."""

    suffix = ".parquet"

    def __enter__(self) -> ParquetWriter:
        from stoker.data.parquet import require_pyarrow

        self._pa, self._pq = require_pyarrow("writing predictions to .parquet")
        super().__enter__()
        self._writer: Any = None
        self._buffer: list[dict[str, np.ndarray]] = []
        self._buffered = 0
        return self

    def _write_columns(self, columns: dict[str, np.ndarray]) -> None:
        self._buffer.append(columns)
        self._buffered += len(columns["index"])
        if self._buffered >= _ROW_GROUP:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        names = list(self._buffer[0])
        table = self._pa.table(
            {name: np.concatenate([part[name] for part in self._buffer]) for name in names}
        )
        if self._writer is None:
            self._writer = self._pq.ParquetWriter(str(self.tmp), table.schema)
        self._writer.write_table(table)
        self._buffer, self._buffered = [], 0

    def _finish(self) -> None:
        self._flush()
        if self._writer is None:  # no rows at all: still a valid, empty file
            self._pq.write_table(self._pa.table({"index": np.zeros(0, np.int64)}), str(self.tmp))
        else:
            self._writer.close()

    def _abandon(self) -> None:
        if self._writer is not None:
            self._writer.close()


class NpyWriter(PredictionWriter):
    """The raw outputs as one .npy array, ``[N, ...]`` float32.

    With the number of samples known the array is a memory-mapped file filled batch by
    batch; without (iterable data) the batches are kept and saved at the end.
    """

    suffix = ".npy"

    def __enter__(self) -> NpyWriter:
        super().__enter__()
        self._array: np.ndarray | None = None
        self._parts: list[np.ndarray] = []
        return self

    def _write_outputs(self, outputs: torch.Tensor, targets: Any) -> None:
        batch = outputs.numpy().astype(np.float32, copy=False)
        if batch.ndim == 0:
            batch = batch.reshape(1)
        if self.expected_rows is None:
            self._parts.append(batch)
            return
        if self._array is None:
            shape = (self.expected_rows, *batch.shape[1:])
            self._array = np.lib.format.open_memmap(
                self.tmp, mode="w+", dtype=np.float32, shape=shape
            )
        end = self.rows + batch.shape[0]
        if end > self._array.shape[0] or batch.shape[1:] != self._array.shape[1:]:
            raise DataError(
                f"batch of outputs {list(batch.shape)} does not fit the array "
                f"{list(self._array.shape)} being written to {self.path}",
                hint="the data gave more samples than its len(), or outputs of varying shape",
            )
        self._array[self.rows : end] = batch

    def _finish(self) -> None:
        if self._array is not None:
            if self.rows != self._array.shape[0]:
                raise DataError(
                    f"the data gave {self.rows} samples, its len() said {self._array.shape[0]}"
                )
            self._array.flush()
            self._array = None
        elif self._parts or self.expected_rows == 0:
            array = np.concatenate(self._parts) if self._parts else np.zeros(0, np.float32)
            np.save(self.tmp, array)

    def _abandon(self) -> None:
        self._array = None


_WRITERS: dict[str, type[PredictionWriter]] = {
    ".parquet": ParquetWriter,
    ".csv": CsvWriter,
    ".npy": NpyWriter,
}


def open_writer(path: str | Path) -> type[PredictionWriter]:
    """The writer class for ``path``'s suffix (``.parquet``, ``.csv``, ``.npy``).

    Raises:
        ConfigError: Another suffix.
    """
    suffix = Path(path).suffix.lower()
    writer = _WRITERS.get(suffix)
    if writer is None:
        raise ConfigError(
            f"--out {path}: stoker writes predictions as .parquet, .csv or .npy, "
            f"not {suffix or 'a file without a suffix'}",
            hint=f"--out {Path(path).with_suffix('.parquet')}",
        )
    return writer
