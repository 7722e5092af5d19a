"""Tests for stoker.observe.sinks."""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.errors import StokerError
from stoker.observe.sinks import (
    JsonlSink,
    MetricSink,
    MultiSink,
    NullSink,
    TensorBoardSink,
    build_sinks,
    tensorboard_available,
)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.fixture
def no_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes `import tensorboard` and `import torch.utils.tensorboard` fail, as when missing."""
    # A None entry in sys.modules makes the import raise ImportError and find_spec return None.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)


class _Recorder:
    def __init__(self) -> None:
        self.records: list[dict] = []
        self.closed = 0

    def log(self, record) -> None:
        self.records.append(dict(record))

    def close(self) -> None:
        self.closed += 1


def test_jsonl_lines_parse_back_equal_with_types(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "run" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log({"step": 1, "epoch": 0, "train/loss": 0.5, "note": "warmup"})
    sink.log(
        {
            "step": torch.tensor(2),
            "train/loss": torch.tensor(0.25),
            "val/accuracy": np.float32(0.75),
            "samples": np.int64(64),
        }
    )
    sink.close()

    rows = _read_jsonl(path)
    assert rows == [
        {"step": 1, "epoch": 0, "train/loss": 0.5, "note": "warmup"},
        {"step": 2, "train/loss": 0.25, "val/accuracy": 0.75, "samples": 64},
    ]
    assert type(rows[1]["step"]) is int
    assert type(rows[1]["samples"]) is int
    assert type(rows[1]["train/loss"]) is float
    # Written as JSON ints, not floats like 2.0.
    assert '"step": 2,' in path.read_text(encoding="utf-8").splitlines()[1]


def test_jsonl_flushes_each_record_before_close(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log({"step": 1, "train/loss": 1.0})
    assert _read_jsonl(path) == [{"step": 1, "train/loss": 1.0}]
    sink.close()


def test_jsonl_nonfinite_become_null_and_are_listed(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log(
        {
            "step": 3,
            "train/loss": float("nan"),
            "grad/norm": torch.tensor(float("inf")),
            "val/loss": np.float64("-inf"),
            "lr": 0.1,
        }
    )
    sink.log({"step": 4, "train/loss": 0.5})
    sink.close()

    first, second = _read_jsonl(path)
    assert first == {
        "step": 3,
        "train/loss": None,
        "grad/norm": None,
        "val/loss": None,
        "lr": 0.1,
        "nonfinite": ["train/loss", "grad/norm", "val/loss"],
    }
    assert "nonfinite" not in second
    assert "NaN" not in path.read_text(encoding="utf-8")


def test_jsonl_appends_across_instances(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path)
    first.log({"step": 1, "train/loss": 1.0})
    first.close()
    second = JsonlSink(path)
    second.log({"step": 2, "train/loss": 0.5})
    second.close()
    assert _read_jsonl(path) == [
        {"step": 1, "train/loss": 1.0},
        {"step": 2, "train/loss": 0.5},
    ]


def test_jsonl_resume_after_torn_last_line_starts_a_new_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "train/lo', encoding="utf-8")
    sink = JsonlSink(path)
    sink.log({"step": 3, "train/loss": 0.5})
    sink.close()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[1] == '{"step": 2, "train/lo'
    assert json.loads(lines[2]) == {"step": 3, "train/loss": 0.5}


def test_jsonl_rejects_non_scalar_tensor_naming_the_key(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "metrics.jsonl")
    with pytest.raises(StokerError, match="train/loss"):
        sink.log({"step": 1, "train/loss": torch.tensor([0.1, 0.2])})
    with pytest.raises(StokerError, match="reserved"):
        sink.log({"step": 1, "nonfinite": "x"})
    sink.close()
    assert (tmp_path / "metrics.jsonl").read_text(encoding="utf-8") == ""


def test_tensorboard_sink_scalars_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    sink = TensorBoardSink(log_dir)
    sink.log({"step": 10, "epoch": 1, "train/loss": 0.5, "note": "skipped", "lr": 0.01})
    sink.log({"step": 20, "epoch": 1, "train/loss": torch.tensor(0.25), "lr": 0.005})
    sink.close()

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["scalars"]) == ["lr", "train/loss"]
    loss = accumulator.Scalars("train/loss")
    assert [event.step for event in loss] == [10, 20]
    assert [event.value for event in loss] == pytest.approx([0.5, 0.25])
    assert [event.value for event in accumulator.Scalars("lr")] == pytest.approx([0.01, 0.005])


def test_tensorboard_sink_missing_package_names_extra(no_tensorboard: None, tmp_path: Path) -> None:
    assert tensorboard_available() is False
    with pytest.raises(StokerError) as caught:
        TensorBoardSink(tmp_path / "tb")
    assert "tensorboard" in caught.value.message.lower()
    assert caught.value.hint is not None
    assert "stoker[tensorboard]" in caught.value.hint
    assert "tracking.tensorboard=false" in caught.value.hint


def test_build_sinks_auto_without_tensorboard_warns_once(
    no_tensorboard: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="stoker"):
        sink = build_sinks(tmp_path)
    sink.log({"step": 1, "train/loss": 0.5})
    sink.close()

    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].name == "stoker"
    assert "stoker[tensorboard]" in warnings[0].getMessage()
    assert [type(s) for s in sink.sinks] == [JsonlSink]
    assert _read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "train/loss": 0.5}]
    assert not (tmp_path / "tb").exists()


def test_build_sinks_tensorboard_true_but_missing_raises(
    no_tensorboard: None, tmp_path: Path
) -> None:
    with pytest.raises(StokerError, match="TensorBoard"):
        build_sinks(tmp_path, tensorboard=True)


def test_build_sinks_with_tensorboard_writes_both(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="stoker"):
        sink = build_sinks(tmp_path, tensorboard="auto")
    sink.log({"step": 1, "train/loss": 0.5})
    sink.close()
    assert caplog.records == []
    assert [type(s) for s in sink.sinks] == [JsonlSink, TensorBoardSink]
    assert (tmp_path / "metrics.jsonl").exists()
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_build_sinks_all_off_is_empty(tmp_path: Path) -> None:
    sink = build_sinks(tmp_path, jsonl=False, tensorboard=False)
    sink.log({"step": 1})
    sink.close()
    assert sink.sinks == ()
    assert list(tmp_path.iterdir()) == []


def test_multisink_fans_out_and_closes_all() -> None:
    first, second = _Recorder(), _Recorder()
    sink = MultiSink([first, second])
    sink.log({"step": 1, "train/loss": 0.5})
    sink.log({"step": 2, "train/loss": 0.25})
    sink.close()
    expected = [{"step": 1, "train/loss": 0.5}, {"step": 2, "train/loss": 0.25}]
    assert first.records == expected
    assert second.records == expected
    assert (first.closed, second.closed) == (1, 1)


def test_multisink_close_closes_others_when_one_fails() -> None:
    class Broken(_Recorder):
        def close(self) -> None:
            raise OSError("disk gone")

    after = _Recorder()
    sink = MultiSink([Broken(), after])
    with pytest.raises(OSError, match="disk gone"):
        sink.close()
    assert after.closed == 1


def test_null_sink_accepts_and_ignores() -> None:
    sink = NullSink()
    sink.log({"step": 1, "train/loss": math.nan})
    sink.close()
    assert isinstance(sink, MetricSink)
    assert isinstance(MultiSink([]), MetricSink)
