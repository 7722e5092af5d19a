"""Use a trained run: load_model, evaluate and predict on the digits example (examples/images).

One short run of examples/images/digits.yaml (1 epoch) is trained once for the module,
through the CLI's own ``main`` in this process; the tests then use it as a user would.
The example's folder is written small here (four 16×16 grayscale PNGs per digit, with the
manifest make_data.py writes), so the run and the predictions take a second, not the
1,797 images make_data.py would write.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from PIL import Image

import stoker
from stoker.checkpoint import load_checkpoint
from stoker.checkpoint.layout import read_pointer
from stoker.cli.main import main
from stoker.errors import CheckpointError, ConfigError

EXAMPLES = Path(__file__).parents[2] / "examples" / "images"
PER_CLASS = 4
ROWS = 10 * PER_CLASS


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A trained digits run dir, and its data folder (four images per digit)."""
    root = tmp_path_factory.mktemp("use-run")
    data, run_dir = root / "digits", root / "run"
    pixels = np.random.default_rng(0).integers(0, 256, (10, PER_CLASS, 16, 16), dtype=np.uint8)
    for digit in range(10):
        (data / str(digit)).mkdir(parents=True)
        for index in range(PER_CLASS):
            image = Image.fromarray(pixels[digit, index], mode="L")
            image.save(data / str(digit) / f"{digit}{index:03d}.png")
    # What make_data.py:digits_png checks before it reuses a folder instead of writing one.
    manifest = {"dataset": "digits", "version": 1, "files": ROWS}
    (data / "stoker-example.json").write_text(json.dumps(manifest))
    train(EXAMPLES / "digits.yaml", run_dir, f"data.train.args.root={data}")
    return run_dir, data


def train(config: Path, run_dir: Path, *overrides: str) -> None:
    """Train ``config`` for one epoch through the CLI's ``main``, in this process."""
    # The run seeds the global RNGs; give the tests that follow the state they had.
    states = torch.get_rng_state(), np.random.get_state(), random.getstate()
    threads = torch.get_num_threads()
    try:
        code = main(
            [
                "train", str(config), *overrides, "train.epochs=1",
                "tracking.tensorboard=false", "--run-dir", str(run_dir), "--quiet",
            ]
        )  # fmt: skip
    finally:
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
        random.setstate(states[2])
        torch.set_num_threads(threads)
    assert code == 0


def test_predict_writes_one_row_per_input_in_each_format(
    digits_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, few = digits_run
    rows = ROWS
    out = tmp_path / "preds.parquet"
    assert main(["predict", str(run_dir), str(few), "--out", str(out)]) == 0
    assert f"wrote {rows} predictions (best weights)" in capsys.readouterr().out
    table = pq.read_table(out).to_pydict()
    assert table["index"] == list(range(rows))
    assert set(table) == {"index", "prediction", "probability", "label", "target"}
    assert all(0 <= p < 10 for p in table["prediction"])
    assert all(0.1 <= p <= 1.0 for p in table["probability"])  # a softmax max of 10
    assert table["label"] == [str(p) for p in table["prediction"]]  # the folder names
    assert table["target"] == [d for d in range(10) for _ in range(PER_CLASS)]

    csv_out, npy_out = tmp_path / "preds.csv", tmp_path / "preds.npy"
    assert main(["predict", str(run_dir), str(few), "--out", str(csv_out), "--quiet"]) == 0
    lines = csv_out.read_text().splitlines()
    assert lines[0] == "index,prediction,probability,label,target" and len(lines) == rows + 1
    assert main(["predict", str(run_dir), str(few), "--out", str(npy_out), "--quiet"]) == 0
    logits = np.load(npy_out)
    assert logits.shape == (rows, 10)
    assert logits.argmax(axis=1).tolist() == table["prediction"]
    # Only the finished files: no temporary file is left beside them.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["preds.parquet", "preds.csv", "preds.npy"]
    )
    if os.name == "posix":
        umask = os.umask(0o022)
        os.umask(umask)
        assert out.stat().st_mode & 0o777 == 0o666 & ~umask
        assert (run_dir / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask


def test_predict_refuses_an_unknown_suffix_before_any_work(
    digits_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, few = digits_run
    assert main(["predict", str(run_dir), str(few), "--out", str(tmp_path / "p.xlsx")]) == 2
    assert ".parquet, .csv or .npy" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_predict_on_the_builtin_digits_run_reads_a_plain_file_of_inputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The reference run (examples/digits.yaml, what ``stoker demo`` trains) reads the
    built-in ``digits``, which has no file to point at: INPUT is a plain file of inputs."""
    from sklearn.datasets import load_digits

    run_dir = tmp_path / "run"
    train(EXAMPLES.parent / "digits.yaml", run_dir)
    digits = load_digits()
    pixels = (digits.data[:30] / 16).astype(np.float32)  # as the built-in scales them
    np.save(tmp_path / "x.npy", pixels)
    header = ",".join(f"p{i}" for i in range(64))
    rows = "\n".join(",".join(f"{v:g}" for v in row) for row in pixels[:20])
    (tmp_path / "x.csv").write_text(f"{header}\n{rows}\n")
    expected = stoker.load_model(run_dir)(torch.from_numpy(pixels)).argmax(1).tolist()
    for name, count in (("x.npy", 30), ("x.csv", 20)):
        out = tmp_path / f"{name}.parquet"
        assert main(["predict", str(run_dir), str(tmp_path / name), "--out", str(out)]) == 0
        table = pq.read_table(out).to_pydict()
        assert table["index"] == list(range(count))  # one prediction per input row
        assert set(table) == {"index", "prediction", "probability"}  # no target in the file
        assert table["prediction"] == expected[:count]
    assert "wrote 20 predictions (best weights)" in capsys.readouterr().out
    assert main(["predict", str(run_dir), str(tmp_path), "--out", str(tmp_path / "p.csv")]) == 2
    error = capsys.readouterr().err
    assert "data spec digits reads no file" in error and ".npy, .csv or .parquet" in error


def test_predict_reads_every_row_of_a_table_in_order_with_or_without_the_target(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that split validation and test shares off its CSV predicts a whole CSV:
    every row, in the file's order (the shares are not split off the input again), and
    a table of inputs alone, without the target column."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3)).round(4)
    y = x @ np.array([1.0, -2.0, 0.5])
    rows = "\n".join(",".join(f"{v:g}" for v in (*r, t)) for r, t in zip(x, y, strict=True))
    (tmp_path / "train.csv").write_text(f"a,b,c,y\n{rows}\n")
    inputs = "\n".join(",".join(f"{v:g}" for v in r) for r in x)
    (tmp_path / "inputs.csv").write_text(f"a,b,c\n{inputs}\n")
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "mlp", "args": {"in_features": 3, "out_features": 1}},
                "data": {
                    "train": {"name": "csv", "args": {"path": "train.csv", "target": "y"}},
                    "val_fraction": 0.25,
                    "test_fraction": 0.25,
                },
                "loss": {"name": "mse"},
                "loader": {"batch_size": 8},
                "train": {"metrics": ["r2"]},
            }
        )
    )
    run_dir = tmp_path / "run"
    train(config, run_dir)
    model = stoker.load_model(run_dir)
    expected = model(torch.tensor(x, dtype=torch.float32)).squeeze(1).tolist()
    for name in ("train.csv", "inputs.csv"):
        out = tmp_path / f"{name}.parquet"
        assert main(["predict", str(run_dir), str(tmp_path / name), "--out", str(out)]) == 0
        table = pq.read_table(out).to_pydict()
        assert table["index"] == list(range(40))
        assert table["prediction"] == pytest.approx(expected, rel=1e-5)
        if name == "train.csv":
            assert table["target"] == pytest.approx(y.tolist(), rel=1e-4)  # the file's order
        else:
            assert "target" not in table
    assert main(["evaluate", str(run_dir), "--data", str(tmp_path / "train.csv")]) == 0
    printed = capsys.readouterr().out
    assert "(40 samples)" in printed
    assert "eval/r2: " in printed  # the run's train.metrics, besides the task's own


def test_evaluate_measures_a_step_fn_run_as_it_validated(tmp_path: Path) -> None:
    """The two-headed example's model returns two outputs, which only its step_fn
    scores: evaluate uses it, as the run's validation did."""
    run_dir = tmp_path / "run"
    train(EXAMPLES.parent / "two_heads" / "two_heads.yaml", run_dir, "callbacks=[]")
    result = stoker.evaluate_run(run_dir, which="last")
    record = load_checkpoint(read_pointer(run_dir / "checkpoints", "last"))["history"][-1]
    names = ("loss", "kind_loss", "weight_loss", "kind_accuracy", "weight_mae_kg")
    assert set(result["metrics"]) == {f"eval/{name}" for name in names}
    for name in names:
        assert result["metrics"][f"eval/{name}"] == pytest.approx(record[f"val/{name}"], rel=1e-5)


def test_evaluate_prints_and_writes_the_validation_metrics(
    digits_run: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, few = digits_run
    assert main(["evaluate", str(run_dir), "--which", "last"]) == 0
    printed = capsys.readouterr().out
    written = json.loads((run_dir / "eval-last.json").read_text())
    # digits.yaml validates on 20% of the images, the same split as the run's.
    assert written["samples"] == ROWS // 5 and written["which"] == "last"
    assert set(written["metrics"]) == {"eval/loss", "eval/accuracy"}
    assert f"eval/accuracy: {written['metrics']['eval/accuracy']:.6g}" in printed
    # The last checkpoint's own val/accuracy, measured by the run on the same split.
    record = load_checkpoint(read_pointer(run_dir / "checkpoints", "last"))["history"][-1]
    assert written["metrics"]["eval/accuracy"] == pytest.approx(record["val/accuracy"])
    assert written["metrics"]["eval/loss"] == pytest.approx(record["val/loss"], rel=1e-5)

    out = tmp_path / "few.json"
    assert main(["evaluate", str(run_dir), "--data", str(few), "--out", str(out)]) == 0
    on_few = json.loads(out.read_text())
    assert on_few["samples"] == ROWS and on_few["which"] == "best"


def test_load_model_rebuilds_the_model_with_best_or_last_weights(
    digits_run: tuple[Path, Path],
) -> None:
    run_dir, _ = digits_run
    model = stoker.load_model(run_dir)
    assert not model.training
    best = load_checkpoint(read_pointer(run_dir / "checkpoints", "best"))["model"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, best[name]), name
    last = stoker.load_model(run_dir, which="last")
    assert type(last).__name__ == "SmallCNN"


def test_a_fit_run_loads_into_the_users_model_and_missing_best_is_named(
    tmp_path: Path, toy_classification: tuple[torch.Tensor, torch.Tensor]
) -> None:
    net = torch.nn.Linear(8, 3)
    run_dir = tmp_path / "run"
    stoker.fit(
        net, toy_classification, epochs=1, run_dir=run_dir, progress="quiet",
        tensorboard=False, keep_best=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"pass it: load_model\(run_dir, model="):
        stoker.load_model(run_dir, which="last")
    loaded = stoker.load_model(run_dir, which="last", model=torch.nn.Linear(8, 3))
    assert torch.equal(loaded.weight, net.weight.detach())
    with pytest.raises(CheckpointError, match="has no best checkpoint") as error:
        stoker.load_model(run_dir, model=torch.nn.Linear(8, 3))
    assert "--which last" in str(error.value)
