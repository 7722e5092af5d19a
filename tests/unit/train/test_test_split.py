"""The test split: data.test / test_fraction, evaluated once at the end, best or last weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import stoker
from stoker.checkpoint import load_checkpoint
from stoker.config import load_config
from stoker.data.sources import ArrayDataset, split_train_val_test
from stoker.errors import ConfigError
from stoker.observe.report import read_metrics
from stoker.train.session import train_run

OPTIONS = dict(batch_size=32, lr=0.05, progress="quiet", tensorboard=False)


def _test_loss_and_accuracy(model, features, labels):
    """The figures worked out directly: the mean cross entropy and accuracy over the set."""
    with torch.no_grad():
        outputs = model(features)
    loss = torch.nn.functional.cross_entropy(outputs, labels).item()
    return loss, (outputs.argmax(1) == labels).float().mean().item()


@pytest.mark.parametrize("weights", ["best", "last"])
def test_test_fraction_is_evaluated_with_the_chosen_weights(
    tmp_path, toy_classification, mlp_factory, weights
) -> None:
    x, y = toy_classification
    # monitor_mode=max on val/loss makes the first epoch the best: best and last differ.
    result = stoker.fit(
        mlp_factory(),
        (x, y),
        epochs=3,
        val_fraction=0.2,
        test_fraction=0.25,
        monitor="val/loss",
        monitor_mode="max",
        test_checkpoint=weights,
        metrics=["f1"],
        log_every_steps=1,
        run_dir=tmp_path,
        **OPTIONS,
    )
    assert result.best_epoch == 1
    _, _, test = split_train_val_test(
        ArrayDataset(x, y), val_fraction=0.2, test_fraction=0.25, seed=0
    )
    features, labels = test.arrays  # type: ignore[attr-defined]
    assert len(labels) == 64
    if weights == "best":
        best = json.loads((tmp_path / "checkpoints" / "best.json").read_text())["checkpoint"]
        model = mlp_factory()
        model.load_state_dict(load_checkpoint(tmp_path / "checkpoints" / best)["model"])
        epoch = 1
    else:
        model, epoch = result.model, 3
    loss, accuracy = _test_loss_and_accuracy(model, features, labels)
    assert result.test_metrics["test/loss"] == pytest.approx(loss, rel=1e-5)
    assert result.test_metrics["test/accuracy"] == pytest.approx(accuracy)
    assert "test/f1" in result.test_metrics
    # The returned and exported model keeps the last weights either way.
    exported = load_file(tmp_path / "model.safetensors")
    for name, value in result.model.state_dict().items():
        assert torch.equal(value, exported[name])
    # Reported separately: one test record in metrics.jsonl, summary.json's "test".
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    tests = [line for line in lines if any(key.startswith("test/") for key in line)]
    assert len(tests) == 1 and tests[0]["epoch"] == epoch
    assert tests[0]["test/loss"] == result.test_metrics["test/loss"]
    assert not any(key.startswith("test/") for key in result.metrics)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["test"] == {"weights": weights, "epoch": epoch, **result.test_metrics}
    # The report's reading of metrics.jsonl keeps every record beside the test one (which
    # has the last step's number).
    log = read_metrics(tmp_path / "metrics.jsonl")
    assert len(log.epoch_records) == 3
    steps = [r["step"] for r in log.step_records if "train/loss" in r]
    assert steps == list(range(1, result.history[-1]["step"] + 1))
    assert "<h3>test</h3>" in (tmp_path / "report.html").read_text()  # summary.json's test


def test_data_test_from_a_config_file_auto_picks_best(tmp_path) -> None:
    generator = np.random.default_rng(0)
    header = "a,b,c,y"

    def write(name: str, rows: int) -> None:
        features = generator.normal(size=(rows, 3))
        labels = (features[:, 0] > 0).astype(int)
        table = np.column_stack([features, labels])
        np.savetxt(
            tmp_path / name,
            table,
            delimiter=",",
            header=header,
            comments="",
            fmt=["%.6f"] * 3 + ["%d"],
        )

    write("train.csv", 96)
    write("val.csv", 32)
    write("test.csv", 40)
    csv = {"name": "csv", "args": {"target": "y", "target_dtype": "int64"}}
    config = {
        "model": {"name": "mlp", "args": {"in_features": 3, "out_features": 2, "hidden": [8]}},
        "data": {
            "train": {**csv, "args": {**csv["args"], "path": "train.csv"}},
            "val": {**csv, "args": {**csv["args"], "path": "val.csv"}},
            "test": {**csv, "args": {**csv["args"], "path": "test.csv"}},
        },
        "loader": {"batch_size": 16},
        "train": {"epochs": 2, "device": "cpu", "metrics": ["precision", "recall"]},
        "tracking": {"run_dir": "run", "tensorboard": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    result = train_run(load_config(path), progress="quiet")
    assert set(result.test_metrics) == {
        "test/loss",
        "test/accuracy",
        "test/precision",
        "test/recall",
    }
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["test"]["weights"] == "best"
    assert summary["test"]["epoch"] == result.best_epoch


def test_best_weights_need_a_best_checkpoint(tmp_path, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    with pytest.raises(ConfigError, match="data.test_checkpoint=best, but this run keeps no"):
        stoker.fit(
            mlp_factory(),
            (x, y),
            test_data=(x[:32], y[:32]),
            test_checkpoint="best",
            keep_best=False,
            run_dir=tmp_path,
            **OPTIONS,
        )


def test_without_checkpoints_auto_tests_the_last_weights(tmp_path, toy_classification, mlp_factory):
    x, y = toy_classification
    result = stoker.fit(
        mlp_factory(),
        (x[:192], y[:192]),
        test_data=(x[192:], y[192:]),
        epochs=2,
        enabled=False,
        run_dir=tmp_path,
        **OPTIONS,
    )
    loss, accuracy = _test_loss_and_accuracy(result.model, x[192:], y[192:])
    assert result.test_metrics["test/loss"] == pytest.approx(loss, rel=1e-5)
    assert result.test_metrics["test/accuracy"] == pytest.approx(accuracy)
    assert json.loads((tmp_path / "summary.json").read_text())["test"]["weights"] == "last"


def test_monitoring_a_test_metric_is_refused(toy_classification, mlp_factory, tmp_path) -> None:
    x, y = toy_classification
    with pytest.raises(ConfigError, match="test data is evaluated once"):
        stoker.fit(
            mlp_factory(),
            (x, y),
            test_fraction=0.2,
            monitor="test/loss",
            run_dir=tmp_path,
            **OPTIONS,
        )


def test_test_settings_are_checked_with_the_config() -> None:
    from stoker.config import validate_config

    with pytest.raises(ConfigError, match="leaves no training data"):
        validate_config({"data": {"val_fraction": 0.5, "test_fraction": 0.5}})
    with pytest.raises(ConfigError, match="data.test and data.test_fraction are both set"):
        validate_config({"data": {"test": {"name": "digits"}, "test_fraction": 0.1}})


def test_a_run_a_callback_stops_mid_epoch_tests_the_epoch_it_was_in(
    tmp_path, toy_classification, mlp_factory, capsys
) -> None:
    class StopAtStep3:
        def on_step_end(self, loop, step) -> None:
            if step.step == 3:
                loop.request_stop("enough")

    x, y = toy_classification
    result = stoker.fit(
        mlp_factory(),
        (x, y),
        epochs=2,
        val_fraction=0.2,
        test_fraction=0.25,
        callbacks=[StopAtStep3()],
        run_dir=tmp_path,
        **{**OPTIONS, "progress": "plain"},
    )
    assert result.stop_reason == "enough" and not result.history
    # Epochs count from 1 everywhere: the weights of step 3 are epoch 1's, as the
    # checkpoint saved at that step says.
    last = json.loads((tmp_path / "checkpoints" / "last.json").read_text())
    assert last["epoch"] == 1
    assert json.loads((tmp_path / "summary.json").read_text())["test"]["epoch"] == 1
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["epoch"] for line in lines if "test/loss" in line] == [1]
    out = capsys.readouterr()
    shown = out.out + out.err
    assert "no best checkpoint was saved (no epoch ended); testing the last weights" in shown
    assert "testing 64 samples with the last weights (epoch 1)" in shown
