"""The seeds' exercises (examples/exercises/) run and show what each exercise asks to observe."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

EXERCISES = Path(__file__).parents[2] / "examples" / "exercises"


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # Tiny models on a shared, busy machine: one intra-op thread is faster and steadier.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(name: str) -> ModuleType:
    """Import an exercise by module name, so DataLoader workers can import it too."""
    if str(EXERCISES) not in sys.path:
        sys.path.insert(0, str(EXERCISES))
    return importlib.import_module(name)


def test_ex1_autograd_gradient_is_246() -> None:
    figures = load("ex1_autograd").main()
    assert figures["y"] == pytest.approx(430.0)  # 3·125 + 2·25 + 5
    assert figures["grad"] == pytest.approx(246.0)  # 9·25 + 4·5 + 1
    assert figures["grad"] == figures["expected_grad"]


def test_ex2_accumulation_doubles_then_zero_resets(tmp_path: Path) -> None:
    figures = load("ex2_accumulation").main(samples=128, runs_root=tmp_path)
    assert figures["first"] == pytest.approx(10.0)  # d(x²)/dx at 5
    assert figures["second"] == pytest.approx(2 * figures["first"])
    assert figures["after_zero"] == 0.0
    assert figures["after_zero_backward"] == pytest.approx(figures["first"])
    # 2 accumulated micro-batches of 16 take the same steps as batches of 32.
    assert figures["max_weight_difference"] < 1e-5


def test_ex3_dataset_length_and_sample_shapes() -> None:
    figures = load("ex3_dataset").main()
    assert figures["len"] == 1000
    assert figures["x_shape"] == [10]
    assert figures["y_shape"] == [1]
    assert figures["array_len"] == 1000
    assert figures["array_same"] is True
    assert figures["batch_shapes"] == [[3, 10], [3, 1]]


def test_ex4_dataloader_batches() -> None:
    figures = load("ex4_dataloader").main()
    assert figures["batch_shape"] == [32, 10]
    assert figures["label_shape"] == [32]
    assert figures["num_batches"] == figures["len_loader"] == 32  # ceil(1000 / 32)
    assert figures["last_batch_size"] == 8  # 1000 - 31·32
    assert figures["torch_num_batches"] == 32
    assert figures["torch_last_batch_size"] == 8


def test_ex5_drop_last() -> None:
    figures = load("ex5_drop_last").main()
    assert figures["drop_last=False"] == [32, 32, 32, 4]
    assert figures["drop_last=True"] == [32, 32, 32]


def test_ex6_workers_are_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    figures = load("ex6_workers").main(
        workers=(0, 2), samples=256, ops=5, batch_size=64, runs_root=tmp_path
    )
    assert set(figures) == {"0", "2"}
    for row in figures.values():
        assert row["epoch_s"] > 0
        assert row["batch_wait_ms"] >= 0
        assert row["cpu_pct"] >= 0 and row["workers_cpu_pct"] >= 0
        if not torch.cuda.is_available():
            assert math.isnan(row["gpu_utilization_pct"])
    assert "fastest here: num_workers=" in capsys.readouterr().out


def test_ex7_pad_collate() -> None:
    figures = load("ex7_collate").main()
    assert figures["shape"] == [3, 4]
    assert figures["input_ids"] == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]
    assert figures["attention_mask"] == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert figures["same_as_by_hand"] is True


def test_ex8_pipeline_phase_times(tmp_path: Path) -> None:
    figures = load("ex8_pipeline").main(rows=1024, epochs=1, batch_size=128, runs_root=tmp_path)
    medians = figures["median_ms"]
    assert set(medians) == {"data_wait", "transfer", "forward", "backward", "optimizer", "step"}
    assert all(value >= 0 for value in medians.values())
    assert medians["forward"] > 0 and medians["backward"] > 0 and medians["step"] > 0
    totals = figures["epoch_totals_s"]
    assert sum(totals.values()) <= figures["epoch_s"] * 1.01  # phases are parts of the epoch
    assert figures["verdict"] in {
        "compute-bound",
        "input-bound",
        "partly input-bound",
        "transfer-bound",
    }


def test_ex9_classifier_learns_and_checkpoints(tmp_path: Path) -> None:
    figures = load("ex9_classifier").main(
        train_size=1500, val_size=300, epochs=6, runs_root=tmp_path
    )
    history = figures["history"]
    assert len(history) == 6
    for record in history:
        assert set(record) == {
            "train/loss",
            "val/loss",
            "train/accuracy",
            "val/accuracy",
            "time/epoch_s",
        }
        assert record["time/epoch_s"] > 0
    assert history[-1]["train/loss"] < history[0]["train/loss"]
    assert history[-1]["val/loss"] < history[0]["val/loss"]
    assert history[-1]["val/accuracy"] > 0.85  # chance is 1/3
    assert figures["best_val_accuracy"] >= history[-1]["val/accuracy"]
    assert figures["checkpoint_restores"] is True


def test_clipping_helps_sgd_not_adam(tmp_path: Path) -> None:
    runs = load("clipping").main(rows=2000, epochs=5, runs_root=tmp_path)
    adam_off, adam_on = runs["adam/off"], runs["adam/on"]
    sgd_off, sgd_on = runs["sgd/off"], runs["sgd/on"]
    # Adam at lr 0.5: clipped or not, the loss stays far above a working model's ...
    assert adam_off["loss"][-1] > 1.0 and adam_on["loss"][-1] > 1.0
    assert 1 / 3 < adam_on["loss"][-1] / adam_off["loss"][-1] < 3  # ... and alike.
    # Clipping acted on nearly every Adam step, and stoker said so.
    assert adam_on["clip_rate"][-1] > 0.8
    assert any("gradient clipping acted on" in line for line in adam_on["warnings"])
    assert not any("gradient clipping" in line for line in adam_off["warnings"])
    # SGD at lr 5: clipping limits the step, so the first epoch goes much better.
    assert sgd_on["loss"][0] < sgd_off["loss"][0]
    assert sgd_on["loss"][-1] < 0.5
    assert not any("gradient clipping" in line for line in sgd_on["warnings"])
    # The fix for Adam is a smaller learning rate.
    assert runs["adam-lr0.005/off"]["loss"][-1] < 0.5
