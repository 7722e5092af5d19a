"""Metric sinks: where each logged record of a run goes (JSONL, TensorBoard, nowhere)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from stoker.errors import StokerError
from stoker.safe_files import open_append

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

__all__ = [
    "JsonlSink",
    "MetricSink",
    "MultiSink",
    "NullSink",
    "TensorBoardSink",
    "build_sinks",
    "tensorboard_available",
]

logger = logging.getLogger("stoker")

Record = Mapping[str, float | int | str]

# Keys that index a record rather than measure something; never plotted as scalars.
_INDEX_KEYS = frozenset({"step", "epoch"})
# Key JsonlSink adds to a record that held NaN or inf; callers must not use it.
_NONFINITE_KEY = "nonfinite"
_TENSORBOARD_HINT = "pip install 'stoker[tensorboard]'  (or set tracking.tensorboard=false)"


@runtime_checkable
class MetricSink(Protocol):
    """Anything that receives metric records.

    A record is a flat mapping of ``group/name`` keys to numbers or strings. It always
    holds ``step`` (optimizer steps so far) and usually ``epoch``.
    """

    def log(self, record: Mapping[str, float | int | str]) -> None:
        """Writes one record."""
        ...

    def close(self) -> None:
        """Flushes and releases whatever the sink holds."""
        ...


def tensorboard_available() -> bool:
    """Tells whether the ``tensorboard`` package can be imported."""
    return importlib.util.find_spec("tensorboard") is not None


def _to_python(key: str, value: Any) -> float | int | str:
    """Turns one record value into a plain Python number or string.

    0-d torch tensors and numpy scalars become Python numbers through ``.item()``, which
    keeps integers as ``int``.
    """
    # Asked before the isinstance check below: numpy.float64 subclasses float but should
    # still leave as a plain float.
    item = getattr(value, "item", None)
    if callable(item):
        try:
            # CPU–GPU sync point when ``value`` is a CUDA tensor.
            return item()
        except (RuntimeError, ValueError) as error:
            raise StokerError(
                f"metric {key!r} holds {_shape_of(value)} values; a metric record holds one "
                "number per key",
                hint="log a single number, e.g. `tensor.mean().item()`, or one key per value",
            ) from error
    if isinstance(value, bool | int | float | str):
        return value
    raise StokerError(
        f"metric {key!r} is a {type(value).__name__}; a metric record holds numbers and strings",
        hint="convert it to a float, an int or a str before logging it",
    )


def _shape_of(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"shape {tuple(shape)}" if shape is not None else "several"


class JsonlSink:
    """Appends each record to a JSON Lines file, one object per line.

    The file is opened in append mode, so a resumed run continues the same file, and
    flushed after every record, so a killed run keeps everything it logged.

    NaN and inf are not valid JSON: they are written as ``null`` and their keys listed
    under ``"nonfinite"`` in that record, e.g.
    ``{"step": 7, "train/loss": null, "nonfinite": ["train/loss"]}``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Opens (or creates) the file.

        Args:
            path: The ``.jsonl`` file; missing parent folders are created.
        """
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        needs_newline = _ends_mid_line(self.path)
        # Never through a link: a planted metrics.jsonl symlink must not append elsewhere.
        self._file = open_append(self.path)
        if needs_newline:
            # A run killed mid-write left half a line; start ours on a fresh one so
            # the records appended now still parse.
            self._file.write("\n")

    def log(self, record: Mapping[str, float | int | str]) -> None:
        """Writes one record as one line and flushes it.

        Args:
            record: Flat mapping of metric keys to numbers or strings.

        Raises:
            StokerError: A value is not a number, a string or a one-element tensor/array,
                or the record uses the reserved key ``"nonfinite"``.
        """
        if _NONFINITE_KEY in record:
            raise StokerError(
                f"metric key {_NONFINITE_KEY!r} is reserved: JsonlSink lists NaN/inf keys under it",
                hint=f"rename the metric, e.g. 'custom/{_NONFINITE_KEY}'",
            )
        row: dict[str, float | int | str | None] = {}
        nonfinite: list[str] = []
        for key, raw in record.items():
            value = _to_python(key, raw)
            if isinstance(value, float) and not math.isfinite(value):
                row[key] = None
                nonfinite.append(key)
            else:
                row[key] = value
        if nonfinite:
            row[_NONFINITE_KEY] = nonfinite
        # allow_nan=False: a non-finite value that slipped past the check above raises
        # here instead of writing a line no JSON reader accepts.
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Closes the file; calling it again does nothing."""
        self._file.close()


def _ends_mid_line(path: Path) -> bool:
    """Tells whether ``path`` exists, is not empty and its last byte is not a newline."""
    try:
        with path.open("rb") as file:
            file.seek(0, os.SEEK_END)
            if file.tell() == 0:
                return False
            file.seek(-1, os.SEEK_END)
            return file.read(1) != b"\n"
    except FileNotFoundError:
        return False


class TensorBoardSink:
    """Writes every numeric value of a record as a TensorBoard scalar.

    Each key except ``step`` and ``epoch`` becomes one scalar series, indexed by the
    record's ``step``. String values are skipped on purpose: TensorBoard scalars are
    numbers only, and the JSONL sink keeps the strings.
    """

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        """Creates the event-file writer.

        Args:
            log_dir: Folder for the TensorBoard event files (``<run dir>/tb``).

        Raises:
            StokerError: The optional ``tensorboard`` package is not installed.
        """
        try:
            # Imported here so that stoker works without TensorBoard installed.
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:
            raise StokerError(
                "TensorBoard logging needs the `tensorboard` package, which is not installed",
                hint=_TENSORBOARD_HINT,
            ) from error
        self.log_dir = Path(log_dir)
        self._writer: SummaryWriter = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, record: Mapping[str, float | int | str]) -> None:
        """Adds one scalar per numeric value, at ``global_step=record["step"]``.

        Args:
            record: Flat mapping of metric keys to numbers or strings; must hold ``step``.
        """
        step = int(_to_python("step", record["step"]))
        for key, raw in record.items():
            if key in _INDEX_KEYS:
                continue
            value = _to_python(key, raw)
            if isinstance(value, str):
                continue
            self._writer.add_scalar(key, value, global_step=step)

    def close(self) -> None:
        """Flushes the event file and closes the writer."""
        self._writer.flush()
        self._writer.close()


class NullSink:
    """A sink that drops every record: the stand-in when metric logging is off."""

    def log(self, record: Mapping[str, float | int | str]) -> None:
        """Does nothing."""

    def close(self) -> None:
        """Does nothing."""


class MultiSink:
    """Sends each record to several sinks in order."""

    def __init__(self, sinks: Iterable[MetricSink]) -> None:
        """Keeps the sinks.

        Args:
            sinks: The sinks to fan out to; none at all behaves like ``NullSink``.
        """
        self.sinks: tuple[MetricSink, ...] = tuple(sinks)

    def log(self, record: Mapping[str, float | int | str]) -> None:
        """Logs ``record`` to every sink."""
        for sink in self.sinks:
            sink.log(record)

    def close(self) -> None:
        """Closes every sink, even when one fails, then raises the first failure."""
        first_error: BaseException | None = None
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as error:
                # Keep closing the others: a failing TensorBoard writer must not leave
                # the JSONL file unflushed.
                first_error = first_error or error
        if first_error is not None:
            raise first_error


def build_sinks(
    run_dir: str | os.PathLike[str],
    *,
    jsonl: bool = True,
    tensorboard: bool | Literal["auto"] = "auto",
    mlflow: Mapping[str, Any] | None = None,
) -> MultiSink:
    """Builds the sinks of a run.

    Args:
        run_dir: The run dir; gets ``metrics.jsonl`` and ``tb/``.
        jsonl: Write ``metrics.jsonl``.
        tensorboard: Write TensorBoard event files under ``tb/``. ``"auto"`` writes them
            when the ``tensorboard`` package is installed and logs one warning when not.
        mlflow: Keyword arguments of an ``MlflowSink`` (tracking_uri, experiment, params),
            or None for no MLflow logging.

    Returns:
        One sink that fans out to the enabled ones.

    Raises:
        StokerError: ``tensorboard=True`` but the ``tensorboard`` package is missing.
    """
    run_dir = Path(run_dir)
    if tensorboard == "auto":
        tensorboard = tensorboard_available()
        if not tensorboard:
            logger.warning(
                "TensorBoard logging is off: the `tensorboard` package is not installed "
                "(pip install 'stoker[tensorboard]' to turn it on, or set "
                "tracking.tensorboard=false to silence this warning)"
            )
    sinks: list[MetricSink] = []
    try:
        if jsonl:
            sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
        if tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tb"))
        if mlflow is not None:
            from stoker.observe.mlflow_sink import MlflowSink

            sinks.append(MlflowSink(run_dir=run_dir, **mlflow))
    except BaseException:
        # Do not leak the JSONL file handle when the TensorBoard sink cannot start.
        MultiSink(sinks).close()
        raise
    return MultiSink(sinks)
