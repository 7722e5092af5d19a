"""MLflow tracking: a metric sink that batches, outlives a failing backend, and replays."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import posixpath
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.errors import StokerError
from stoker.safe_files import open_append, write_text

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

__all__ = ["BUFFER_NAME", "MlflowSink", "default_tracking_uri", "flatten_params", "replay_buffer"]

logger = logging.getLogger("stoker")

BUFFER_NAME = "mlflow_buffer.jsonl"
_MLFLOW_HINT = "pip install 'stoker[mlflow]'"
_BUFFER_VERSION = 1
# Keys that index a record rather than measure something.
_INDEX_KEYS = frozenset({"step", "epoch"})
# MLflow's own limits (mlflow.utils.validation); a call over them is rejected whole.
_MAX_METRICS_PER_CALL = 1000
_MAX_PARAMS_PER_CALL = 100
_MAX_PARAM_VALUE_CHARS = 6000
_MAX_NAME_CHARS = 250
# What MLflow accepts in metric and param names on every platform (a colon fails on Windows).
_BAD_NAME_CHARS = re.compile(r"[^\w./\- ]")


def default_tracking_uri(run_dir: str | os.PathLike[str]) -> str:
    """The embedded store: ``sqlite:///<runs_root>/mlflow.db``, beside the run dirs.

    Args:
        run_dir: The run dir; its parent is the runs root that all runs share.
    """
    return "sqlite:///" + (Path(run_dir).resolve().parent / "mlflow.db").as_posix()


def flatten_params(config: Mapping[str, Any], *, prefix: str = "") -> dict[str, str]:
    """Flattens a nested config into MLflow params: ``{"optim.lr": "0.003", ...}``.

    Strings stay as they are; every other value (numbers, booleans, ``None``, lists, an
    empty mapping) is written as JSON, so ``[128, 64]`` and ``null`` read back unambiguously.
    """
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


def _check_installed(tracking_uri: str) -> None:
    """Fails early, naming the extra, when MLflow (or its SQL store's packages) is missing."""
    needed = ["mlflow"]
    if tracking_uri.startswith(("sqlite:", "postgresql", "mysql", "mssql")):
        # mlflow-skinny leaves these out; without them the store fails on first use.
        needed += ["sqlalchemy", "alembic"]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        raise StokerError(
            f"MLflow tracking to {tracking_uri} needs the package(s) {', '.join(missing)}, "
            "which are not installed",
            hint=f"{_MLFLOW_HINT}  (or turn MLflow tracking off)",
        )


def _client(tracking_uri: str) -> MlflowClient:
    _check_installed(tracking_uri)
    # Imported here so that stoker works without MLflow installed.
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


@dataclasses.dataclass
class _Run:
    """Where buffered records go: enough to create the MLflow run later if need be."""

    tracking_uri: str
    experiment: str
    run_name: str | None
    params: dict[str, str]
    tags: dict[str, str]
    artifact_location: str | None = None
    run_id: str | None = None
    params_sent: bool = False
    terminated: bool = False

    def header(self) -> dict[str, Any]:
        return {"mlflow_buffer": _BUFFER_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_header(cls, header: Mapping[str, Any]) -> _Run:
        fields = {field.name for field in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in header.items() if key in fields})


def _ensure_run(client: MlflowClient, run: _Run) -> None:
    """Creates the experiment and the run if not yet done, then logs the params once."""
    if run.run_id is None:
        experiment = client.get_experiment_by_name(run.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = client.create_experiment(
                run.experiment, artifact_location=run.artifact_location
            )
        created = client.create_run(experiment_id, run_name=run.run_name, tags=run.tags)
        run.run_id = created.info.run_id
    if not run.params_sent:
        from mlflow.entities import Param

        params = [Param(key, value) for key, value in run.params.items()]
        # Resending a param with the same value is allowed, so a retry after a partial
        # failure is safe.
        for chunk in _chunks(params, _MAX_PARAMS_PER_CALL):
            client.log_batch(run.run_id, params=chunk)
        run.params_sent = True


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _send(client: MlflowClient, run: _Run, entries: Sequence[dict]) -> tuple[int, Exception | None]:
    """Sends entries in order, in calls of at most 1,000 metrics.

    Returns:
        How many entries (from the front) were sent completely, and the error that stopped
        the rest (``None`` when all went). A resent metric with the same key, step,
        timestamp and value is stored once by MLflow, so resending a half-sent entry is safe.
    """
    from mlflow.entities import Metric

    sent = 0
    try:
        _ensure_run(client, run)
        assert run.run_id is not None
        batch: list[Metric] = []
        for index, entry in enumerate(entries):
            metrics = [
                Metric(key, value, entry["timestamp_ms"], entry["step"])
                for key, value in entry["metrics"].items()
            ]
            while len(batch) + len(metrics) > _MAX_METRICS_PER_CALL:
                room = _MAX_METRICS_PER_CALL - len(batch)
                client.log_batch(run.run_id, metrics=batch + metrics[:room])
                batch, metrics = [], metrics[room:]
                sent = index  # every entry before this one has now gone completely
            batch.extend(metrics)
        if batch:
            client.log_batch(run.run_id, metrics=batch)
        return len(entries), None
    except Exception as error:
        # Any failure (server down, database locked, HTTP error) is the backend's: the
        # caller keeps the unsent entries. Training must never stop for tracking.
        return sent, error


def _write_buffer(path: Path, run: _Run, entries: Sequence[dict], *, append: bool = False) -> None:
    """Replaces the buffer file (atomically) with ``run``'s header and ``entries``, or appends."""
    # Through safe_files: a buffer in the run dir that is a symlink is refused, not followed.
    if append and path.exists() and path.stat().st_size > 0:
        with open_append(path) as file:
            file.writelines(json.dumps(entry) + "\n" for entry in entries)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(run.header()), *(json.dumps(entry) for entry in entries)]
    write_text(path, "".join(line + "\n" for line in lines))


def _read_buffer(path: Path) -> tuple[dict[str, Any], list[dict]]:
    """The header and the entries of a buffer file; a torn last line is skipped, with a warning."""
    lines = path.read_text(encoding="utf-8").splitlines()
    try:
        header = json.loads(lines[0]) if lines else {}
    except json.JSONDecodeError:
        header = {}
    if header.get("mlflow_buffer") != _BUFFER_VERSION:
        raise StokerError(
            f"{path} is not a stoker MLflow buffer (its first line is not the run header)",
            hint="pass the `mlflow_buffer.jsonl` that MlflowSink wrote in the run dir",
        )
    entries: list[dict] = []
    torn = 0
    for line in lines[1:]:
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            torn += 1
    if torn:
        logger.warning("%s: skipped %d unreadable line(s), cut off by a killed process", path, torn)
    return header, entries


class MlflowSink:
    """Sends each record's numbers to an MLflow run, batched, never failing training.

    Params (the flattened config) and a ``stoker.run_dir`` tag are logged with the run.
    Each record's numbers except ``step`` and ``epoch`` become metrics at
    ``step=record["step"]``; strings are skipped (the JSONL sink keeps them). One
    ``log_batch`` call per ``flush_every`` records or ``flush_every_s`` seconds keeps the cost
    at one round trip per batch, not per value.

    When the backend fails (server down, database locked), no metric is lost: the unsent
    records are appended to ``buffer_path``, one warning is logged, and each later flush
    retries (at most every ``retry_after_s`` seconds, since one failing call to a server can
    block for as long as MLflow's own HTTP retries take; see ``MLFLOW_HTTP_REQUEST_MAX_RETRIES``
    and ``MLFLOW_HTTP_REQUEST_TIMEOUT``). ``close`` tries once more and reports what is left;
    :func:`replay_buffer` sends it later. A buffer left by an earlier process in the same run
    dir (a run resumed after a crash) is replayed when the sink starts.
    """

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment: str = "stoker",
        run_name: str | None = None,
        run_dir: str | os.PathLike[str],
        params: Mapping[str, Any] | None = None,
        buffer_path: str | os.PathLike[str] | None = None,
        flush_every: int = 50,
        flush_every_s: float = 30.0,
        retry_after_s: float = 60.0,
    ) -> None:
        """Connects and creates the MLflow run (or buffers, when the backend is down).

        Args:
            tracking_uri: An MLflow server (``http://host:5000``) or store URI; defaults to
                :func:`default_tracking_uri`, a SQLite file shared by all runs in the runs root.
            experiment: The MLflow experiment; created when missing.
            run_name: The MLflow run's name; defaults to the run dir's name.
            run_dir: The run dir; recorded as the ``stoker.run_dir`` tag.
            params: The run config (nested), logged flattened as params.
            buffer_path: Where unsent records wait; defaults to ``<run_dir>/mlflow_buffer.jsonl``.
            flush_every: Send after this many records.
            flush_every_s: Send after this many seconds since the last flush.
            retry_after_s: After a failure, wait this long before the next attempt (records
                logged meanwhile go straight to the buffer).

        Raises:
            StokerError: MLflow (or, for the SQLite store, SQLAlchemy/Alembic) is not installed.
        """
        if flush_every < 1:
            raise StokerError(f"MlflowSink(flush_every={flush_every}): must be at least 1")
        self.run_dir = Path(run_dir)
        self.tracking_uri = tracking_uri or default_tracking_uri(self.run_dir)
        self.buffer_path = Path(buffer_path) if buffer_path else self.run_dir / BUFFER_NAME
        self.flush_every = flush_every
        self.flush_every_s = flush_every_s
        self.retry_after_s = retry_after_s
        self._client = _client(self.tracking_uri)
        self._names: dict[str, str] = {}
        # The embedded store keeps artifacts beside its database, not in the working dir.
        artifacts = None if tracking_uri else (self.run_dir.resolve().parent / "mlartifacts")
        self._run = _Run(
            tracking_uri=self.tracking_uri,
            experiment=experiment,
            run_name=run_name or self.run_dir.name,
            params=self._params(params or {}),
            tags={"stoker.run_dir": str(self.run_dir.resolve())},
            artifact_location=artifacts.as_uri() if artifacts else None,
        )
        self._pending: list[dict] = []
        self._buffered = 0
        self._failed_at: float | None = None
        self._warned = False
        self._closed = False
        self._last_flush = time.monotonic()
        self._replay_earlier_buffer()
        # Create the run now: its id is known from the start, and a backend that is down
        # is reported before the first epoch rather than after it.
        self._attempt()

    @property
    def run_id(self) -> str | None:
        """The MLflow run's id; ``None`` while the backend has not been reachable."""
        return self._run.run_id

    @property
    def buffered(self) -> int:
        """Records waiting in the buffer file (0 while the backend is healthy)."""
        return self._buffered

    def log(self, record: Mapping[str, float | int | str]) -> None:
        """Queues one record's numbers; sends the queue when it is full or old enough.

        Args:
            record: Flat mapping of metric keys to numbers or strings; must hold ``step``.

        Raises:
            StokerError: The record has no ``step``, holds a value that is neither a number
                nor a string, or the sink is closed.
        """
        if self._closed:
            raise StokerError("MlflowSink.log() after close()", hint="create a new sink")
        if "step" not in record:
            raise StokerError(
                f"an MLflow record needs a 'step' key; got {sorted(record)}",
                hint="log records the way the training loop does: {'step': ..., 'train/loss': ...}",
            )
        metrics: dict[str, float] = {}
        for key, raw in record.items():
            value = _number(key, raw)
            if key not in _INDEX_KEYS and value is not None:
                metrics[self._name(key)] = value
        if metrics:
            self._pending.append(
                {
                    "step": int(_number("step", record["step"]) or 0),
                    "timestamp_ms": int(time.time() * 1000),
                    "metrics": metrics,
                }
            )
        elapsed = time.monotonic() - self._last_flush
        if len(self._pending) >= self.flush_every or elapsed >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        """Sends queued and buffered records; while failing, retries every ``retry_after_s``."""
        self._last_flush = time.monotonic()
        if not self._pending and self._failed_at is None:
            return
        if self._failed_at is not None and self._last_flush - self._failed_at < self.retry_after_s:
            _write_buffer(self.buffer_path, self._run, self._pending, append=True)
            self._buffered += len(self._pending)
            self._pending = []
            return
        self._attempt()

    def close(self) -> None:
        """Sends what is left (one last try), ends the MLflow run, reports what stays buffered."""
        if self._closed:
            return
        self._closed = True
        if self._pending or self._failed_at is not None:
            self._attempt()
        if self._failed_at is None and self._run.run_id is not None:
            try:
                self._client.set_terminated(self._run.run_id)
                self._run.terminated = True
            except Exception as error:
                # Left in the buffer's header, so replay_buffer() can end the run later.
                self._fail(error, [])
        if self._failed_at is not None:
            logger.warning(
                "MLflow at %s could not be reached: %d record(s) could not be sent and are "
                "kept in %s; send them when the backend is back with: python -c "
                "\"from stoker.observe.mlflow_sink import replay_buffer; replay_buffer('%s')\"",
                self.tracking_uri,
                self._buffered,
                self.buffer_path,
                self.run_dir,
            )

    def _attempt(self) -> None:
        """One try at sending the buffer file's records, then the queued ones, in order."""
        earlier = _read_buffer(self.buffer_path)[1] if self.buffer_path.exists() else []
        entries = earlier + self._pending
        self._pending = []
        sent, error = _send(self._client, self._run, entries)
        if error is not None:
            self._fail(error, entries[sent:])
            return
        if self._failed_at is not None and entries:
            logger.info("MLflow is reachable again: sent %d buffered record(s)", len(entries))
        self._failed_at = None
        self.buffer_path.unlink(missing_ok=True)
        self._buffered = 0

    def _fail(self, error: Exception, unsent: list[dict]) -> None:
        _write_buffer(self.buffer_path, self._run, unsent)
        self._buffered = len(unsent)
        self._failed_at = time.monotonic()
        message = (
            f"MLflow backend at {self.tracking_uri} failed ({type(error).__name__}: {error}); "
            f"training goes on, unsent records are kept in {self.buffer_path} and retried"
        )
        if self._warned:
            logger.debug(message)
        else:
            # One warning per sink: a server that stays down must not flood the log.
            logger.warning(message)
            self._warned = True

    def _replay_earlier_buffer(self) -> None:
        if not self.buffer_path.exists():
            return
        try:
            sent = replay_buffer(self.run_dir, buffer_path=self.buffer_path)
            logger.info("MLflow: sent %d record(s) buffered by an earlier process", sent)
        except StokerError as error:
            # Keep it for a later replay_buffer(); this sink starts a buffer of its own.
            aside = self.buffer_path.with_name(f"{self.buffer_path.stem}.{int(time.time())}.jsonl")
            os.replace(self.buffer_path, aside)
            logger.warning(
                "%s\n  it is kept in %s; replay it with buffer_path=%r", error, aside, str(aside)
            )

    def _params(self, config: Mapping[str, Any]) -> dict[str, str]:
        params: dict[str, str] = {}
        for key, value in flatten_params(config).items():
            if len(value) > _MAX_PARAM_VALUE_CHARS:
                logger.warning(
                    "MLflow: param %r is %d characters long; logged cut to MLflow's limit of %d",
                    key,
                    len(value),
                    _MAX_PARAM_VALUE_CHARS,
                )
                value = value[: _MAX_PARAM_VALUE_CHARS - 1] + "…"
            params[self._name(key)] = value
        return params

    def _name(self, key: str) -> str:
        """The MLflow name for a stoker key: unchanged unless MLflow would reject it."""
        name = self._names.get(key)
        if name is None:
            name = _BAD_NAME_CHARS.sub("_", key)
            name = posixpath.normpath(name).lstrip("/") if name else "_"
            name = name[:_MAX_NAME_CHARS]
            if name != key:
                logger.warning("MLflow does not accept the name %r; it is logged as %r", key, name)
            self._names[key] = name
        return name


def _number(key: str, value: Any) -> float | None:
    """A record value as a float; ``None`` for a string (not a metric)."""
    item = getattr(value, "item", None)
    if callable(item):
        # CPU–GPU sync point when ``value`` is a CUDA tensor.
        with contextlib.suppress(RuntimeError, ValueError):
            value = item()
    if isinstance(value, str):
        return None
    if isinstance(value, bool | int | float):
        return float(value)
    raise StokerError(
        f"metric {key!r} is a {type(value).__name__}; MLflow metrics are single numbers",
        hint="log a float, an int or a one-element tensor, e.g. `tensor.mean().item()`",
    )


def replay_buffer(
    run_dir: str | os.PathLike[str],
    *,
    tracking_uri: str | None = None,
    buffer_path: str | os.PathLike[str] | None = None,
) -> int:
    """Sends the records an :class:`MlflowSink` could not, and empties the buffer.

    The run recorded in the buffer is continued; when the backend was down from the start,
    the run is created now (with its params and tags). Giving another ``tracking_uri``
    sends everything to a new run in that store.

    Args:
        run_dir: The run dir holding ``mlflow_buffer.jsonl``.
        tracking_uri: Send here instead of the store the sink used.
        buffer_path: The buffer file, when not ``<run_dir>/mlflow_buffer.jsonl``.

    Returns:
        How many records were sent (0 when there is no buffer).

    Raises:
        StokerError: The backend still fails (what was not sent stays in the buffer), or
            the file is not a buffer.
    """
    path = Path(buffer_path) if buffer_path else Path(run_dir) / BUFFER_NAME
    if not path.exists():
        return 0
    header, entries = _read_buffer(path)
    run = _Run.from_header(header)
    if tracking_uri and tracking_uri != run.tracking_uri:
        run = dataclasses.replace(
            run, tracking_uri=tracking_uri, run_id=None, params_sent=False, terminated=False
        )
    client = _client(run.tracking_uri)
    sent, error = _send(client, run, entries)
    if error is None and not run.terminated:
        try:
            client.set_terminated(run.run_id)
            run.terminated = True
        except Exception as failure:
            error = failure
    if error is not None:
        _write_buffer(path, run, entries[sent:])
        raise StokerError(
            f"could not send {len(entries) - sent} buffered MLflow record(s) to "
            f"{run.tracking_uri}: {type(error).__name__}: {error}",
            hint=f"check that the tracking backend is reachable, then replay {path} again",
        )
    path.unlink()
    return sent
