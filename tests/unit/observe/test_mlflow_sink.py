"""Tests for stoker.observe.mlflow_sink (a local SQLite store in tmp_path; no server)."""

from __future__ import annotations

import json
import logging
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from stoker.errors import StokerError
from stoker.observe.mlflow_sink import (
    BUFFER_NAME,
    MlflowSink,
    default_tracking_uri,
    flatten_params,
    replay_buffer,
)
from stoker.observe.sinks import MetricSink

# SQLAlchemy 2.1 deprecates a loader option that MLflow's store still uses; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:mlflow.*")

# Set by the fixture below when the first test here runs, not when pytest collects this
# file: importing MLflow costs ~2.5 s of CPU, which every pytest-xdist worker would pay.
MlflowClient = MlflowException = None


@pytest.fixture(scope="module", autouse=True)
def _mlflow() -> None:
    global MlflowClient, MlflowException
    pytest.importorskip("mlflow", reason="needs the `mlflow` extra")
    pytest.importorskip("sqlalchemy", reason="the SQLite store needs SQLAlchemy")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient


CONFIG = {"name": "digits", "optim": {"name": "adamw", "lr": 0.003}, "model": {"args": {}}}


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "runs" / "digits-1"


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite store with MLflow's tables, made once: creating them takes about a second."""
    path = tmp_path_factory.mktemp("store") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path.as_posix()}").search_experiments()
    return path


@pytest.fixture
def store(tmp_path: Path, empty_store: Path) -> str:
    """The default store of runs in ``tmp_path/runs``, as its URI."""
    path = tmp_path / "runs" / "mlflow.db"
    path.parent.mkdir()
    shutil.copyfile(empty_store, path)
    return f"sqlite:///{path.as_posix()}"


class Backend:
    """Breaks and mends MlflowClient.log_batch, as a tracking server going down and back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.calls = 0

    def break_(self) -> None:
        def fail(client, *args, **kwargs):
            self.calls += 1
            raise MlflowException("API request failed: connection refused")

        self.monkeypatch.setattr(MlflowClient, "log_batch", fail)

    def mend(self) -> None:
        self.monkeypatch.undo()


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> Backend:
    return Backend(monkeypatch)


def _history(store: str, run_id: str, key: str) -> list[tuple[int, float]]:
    metrics = MlflowClient(tracking_uri=store).get_metric_history(run_id, key)
    return sorted((metric.step, metric.value) for metric in metrics)


def _buffered_steps(path: Path) -> list[int]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines[0]["mlflow_buffer"] == 1
    return [line["step"] for line in lines[1:]]


def _losses(count: int) -> list[dict]:
    return [
        {"step": s, "epoch": 0, "train/loss": 1.0 / s, "note": "x"} for s in range(1, count + 1)
    ]


def test_default_store_is_sqlite_beside_the_run_dirs(run_dir: Path, store: str) -> None:
    assert default_tracking_uri(run_dir) == store
    assert store.startswith("sqlite:////")  # an absolute path


def test_flatten_params_joins_keys_and_writes_non_strings_as_json() -> None:
    flat = flatten_params(
        {"name": "digits", "optim": {"lr": 0.003, "betas": [0.9, 0.99]}, "x": None, "a": {}}
    )
    assert flat == {
        "name": "digits",
        "optim.lr": "0.003",
        "optim.betas": "[0.9, 0.99]",
        "x": "null",
        "a": "{}",
    }


def test_logs_params_tags_and_metrics_to_local_store(run_dir: Path, store: str) -> None:
    sink = MlflowSink(run_dir=run_dir, params=CONFIG, flush_every=2)
    assert isinstance(sink, MetricSink)
    assert sink.tracking_uri == store
    for record in _losses(3):
        sink.log(record)
    sink.log({"step": 3, "val/accuracy": torch.tensor(0.75), "grad/layer/0.weight": 2})
    sink.close()

    client = MlflowClient(tracking_uri=store)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "digits-1"
    assert run.data.params == {
        "name": "digits",
        "optim.name": "adamw",
        "optim.lr": "0.003",
        "model.args": "{}",
    }
    assert run.data.tags["stoker.run_dir"] == str(run_dir.resolve())
    assert _history(store, sink.run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, 1.0 / 3)]
    assert _history(store, sink.run_id, "val/accuracy") == [(3, 0.75)]
    assert _history(store, sink.run_id, "grad/layer/0.weight") == [(3, 2.0)]
    # Index keys and strings are not metrics.
    assert set(run.data.metrics) == {"train/loss", "val/accuracy", "grad/layer/0.weight"}
    assert client.get_experiment_by_name("stoker").experiment_id == run.info.experiment_id
    assert not (run_dir / BUFFER_NAME).exists()


def test_records_wait_for_a_full_batch(run_dir: Path, store: str) -> None:
    sink = MlflowSink(run_dir=run_dir, flush_every=3)
    for record in _losses(2):
        sink.log(record)
    assert _history(store, sink.run_id, "train/loss") == []  # still queued
    sink.log(_losses(3)[2])
    assert [step for step, _ in _history(store, sink.run_id, "train/loss")] == [1, 2, 3]
    sink.close()


def test_failing_backend_buffers_every_record_then_flush_sends_them(
    run_dir: Path, store: str, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    sink = MlflowSink(run_dir=run_dir, flush_every=2, retry_after_s=0)
    backend.break_()
    with caplog.at_level(logging.WARNING, logger="stoker"):
        for record in _losses(5):
            sink.log(record)
        sink.flush()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # one warning, however many failed flushes
    assert "connection refused" in warnings[0].getMessage()
    buffer = run_dir / BUFFER_NAME
    assert _buffered_steps(buffer) == [1, 2, 3, 4, 5]
    assert sink.buffered == 5

    backend.mend()  # the server is back
    sink.log({"step": 6, "train/loss": 0.1})
    sink.flush()
    assert [step for step, _ in _history(store, sink.run_id, "train/loss")] == [1, 2, 3, 4, 5, 6]
    assert not buffer.exists()
    assert sink.buffered == 0
    sink.close()
    assert MlflowClient(tracking_uri=store).get_run(sink.run_id).info.status == "FINISHED"


@pytest.mark.usefixtures("store")
def test_while_failing_records_go_to_the_buffer_without_a_retry(
    run_dir: Path, backend: Backend
) -> None:
    sink = MlflowSink(run_dir=run_dir, flush_every=1, retry_after_s=3600)
    backend.break_()
    for record in _losses(4):
        sink.log(record)
    assert backend.calls == 1  # the first failure; the rest wait out retry_after_s
    assert _buffered_steps(run_dir / BUFFER_NAME) == [1, 2, 3, 4]
    sink.close()  # one last try
    assert backend.calls == 2
    assert sink.buffered == 4


def test_close_reports_what_stays_buffered_and_replay_sends_it(
    run_dir: Path, store: str, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    sink = MlflowSink(run_dir=run_dir, flush_every=10, retry_after_s=0)
    backend.break_()
    for record in _losses(3):
        sink.log(record)
    with caplog.at_level(logging.WARNING, logger="stoker"):
        sink.close()
    assert "3 record(s) could not be sent" in caplog.text
    assert "replay_buffer" in caplog.text

    with pytest.raises(StokerError, match="could not send 3 buffered"):
        replay_buffer(run_dir)  # still down: nothing lost, the buffer stays
    assert _buffered_steps(run_dir / BUFFER_NAME) == [1, 2, 3]

    backend.mend()
    assert replay_buffer(run_dir) == 3
    assert [step for step, _ in _history(store, sink.run_id, "train/loss")] == [1, 2, 3]
    assert not (run_dir / BUFFER_NAME).exists()
    assert replay_buffer(run_dir) == 0


def test_server_down_from_the_start_creates_the_run_on_replay(
    run_dir: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens on the discard port: a real "connection refused", without retries.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    server = "http://127.0.0.1:9"
    sink = MlflowSink(tracking_uri=server, run_dir=run_dir, params=CONFIG, flush_every=2)
    assert sink.run_id is None
    for record in _losses(3):
        sink.log(record)
    sink.close()
    assert sink.buffered == 3

    assert replay_buffer(run_dir, tracking_uri=store) == 3
    client = MlflowClient(tracking_uri=store)
    (run,) = client.search_runs([client.get_experiment_by_name("stoker").experiment_id])
    assert run.data.params["optim.lr"] == "0.003"
    assert run.data.tags["stoker.run_dir"] == str(run_dir.resolve())
    assert run.info.status == "FINISHED"
    assert [step for step, _ in _history(store, run.info.run_id, "train/loss")] == [1, 2, 3]


def test_a_buffer_left_by_an_earlier_process_is_sent_on_start(
    run_dir: Path, store: str, backend: Backend
) -> None:
    first = MlflowSink(run_dir=run_dir, flush_every=10)
    backend.break_()
    for record in _losses(2):
        first.log(record)
    first.close()
    backend.mend()

    second = MlflowSink(run_dir=run_dir)  # e.g. the resumed run
    assert [step for step, _ in _history(store, first.run_id, "train/loss")] == [1, 2]
    assert not (run_dir / BUFFER_NAME).exists()
    second.close()


def test_large_records_are_split_into_calls_mlflow_accepts(run_dir: Path, store: str) -> None:
    sink = MlflowSink(run_dir=run_dir, flush_every=3)
    for step in range(1, 4):
        sink.log({"step": step, **{f"grad/layer/p{i}": float(i) for i in range(700)}})
    sink.close()
    assert _history(store, sink.run_id, "grad/layer/p699") == [(1, 699.0), (2, 699.0), (3, 699.0)]


def test_names_mlflow_rejects_are_rewritten_with_a_warning(
    run_dir: Path, store: str, caplog: pytest.LogCaptureFixture
) -> None:
    sink = MlflowSink(run_dir=run_dir, flush_every=1)
    with caplog.at_level(logging.WARNING, logger="stoker"):
        sink.log({"step": 1, "val/top@5": 0.5, "val/nan": math.nan})
    sink.close()
    assert "'val/top@5'" in caplog.text and "'val/top_5'" in caplog.text
    assert _history(store, sink.run_id, "val/top_5") == [(1, 0.5)]
    assert math.isnan(_history(store, sink.run_id, "val/nan")[0][1])


def test_a_call_failing_halfway_keeps_exactly_the_unsent_records(
    run_dir: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = MlflowSink(run_dir=run_dir, flush_every=3, retry_after_s=0)
    real = MlflowClient.log_batch
    calls = []

    def second_call_fails(client, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise MlflowException("connection reset")
        return real(client, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, "log_batch", second_call_fails)
    # 3 x 700 metrics go in calls of 1,000: [1, 1/2 of 2], [rest of 2, 2/3 of 3], [rest of 3].
    for step in range(1, 4):
        sink.log({"step": step, **{f"grad/layer/p{i}": float(step) for i in range(700)}})
    assert _buffered_steps(run_dir / BUFFER_NAME) == [2, 3]  # 1 went whole in the first call
    monkeypatch.undo()
    sink.close()
    for key in ("grad/layer/p0", "grad/layer/p699"):
        assert _history(store, sink.run_id, key) == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert not (run_dir / BUFFER_NAME).exists()


@pytest.mark.usefixtures("store")
def test_record_without_step_or_with_a_list_is_an_error(run_dir: Path) -> None:
    sink = MlflowSink(run_dir=run_dir)
    with pytest.raises(StokerError, match="'step'"):
        sink.log({"train/loss": 0.5})
    with pytest.raises(StokerError, match="single numbers"):
        sink.log({"step": 1, "train/loss": [0.5, 0.4]})
    sink.close()
    with pytest.raises(StokerError, match="after close"):
        sink.log({"step": 2, "train/loss": 0.5})


def test_missing_mlflow_names_the_extra(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(StokerError, match=r"stoker\[mlflow\]"):
        MlflowSink(run_dir=run_dir)
