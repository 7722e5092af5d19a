"""The tabular zoo examples, shortened, through the CLI as a user runs them.

Each run starts from another working directory than the config's, so the examples'
relative paths (``diabetes.csv``, ``models.py:Regressor``) must resolve from the config
file's folder. The bars are ones an untrained model cannot reach.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stoker_cli import run_cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tabular"


def train(config: str, tmp_path: Path, *overrides: str, process: bool = False) -> dict[str, float]:
    """Run ``stoker train`` from ``tmp_path``; the last epoch record of metrics.jsonl.

    ``process``: in a fresh interpreter, as a user runs it (the suite's one successful
    single-process ``stoker train`` subprocess); otherwise the same ``main`` in-process.
    """
    run_dir = tmp_path / "run"
    if not process:
        args = ["train", EXAMPLES / config, *overrides, "--run-dir", run_dir, "--progress", "plain"]
        done = run_cli(*args, cwd=tmp_path, threads=1)
        assert done.returncode == 0, done.stderr
        return _last_val_record(run_dir)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "stoker",
            "train",
            str(EXAMPLES / config),
            *overrides,
            "--run-dir",
            str(run_dir),
            "--progress",
            "plain",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return _last_val_record(run_dir)


def _last_val_record(run_dir: Path) -> dict[str, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if any(key.startswith("val/") for key in r)][-1]


def test_diabetes_regression_reports_real_errors_for_an_n_by_1_output(tmp_path: Path) -> None:
    """Output (N, 1) against targets (N,): trained as meant, MAE and MSE measured."""
    last = train("diabetes.yaml", tmp_path, "train.epochs=15", process=True)
    # Predicting the training mean gives MAE ≈ 64 on this split; a broadcast (N, N) loss
    # trains towards it and used to print val/mae 0.0000.
    assert 30.0 < last["val/mae"] < 56.0
    assert last["val/mse"] == pytest.approx(last["val/loss"], rel=1e-5)
    assert last["val/mse"] > last["val/mae"] ** 2 * 0.99  # E[e²] ≥ E[|e|]²


def test_breast_cancer_parquet_with_a_balanced_sampler(tmp_path: Path) -> None:
    last = train("breast_cancer.yaml", tmp_path, "train.epochs=8")
    assert last["val/accuracy"] >= 0.9  # the majority class is 0.63


def test_the_committed_data_is_what_make_data_writes(tmp_path: Path) -> None:
    """The examples' files come from scikit-learn's sets, as make_data.py says."""
    pytest.importorskip("sklearn")
    pq = pytest.importorskip("pyarrow.parquet")
    spec = importlib.util.spec_from_file_location("tabular_make_data", EXAMPLES / "make_data.py")
    make_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_data)
    make_data.write_diabetes_csv(tmp_path / "diabetes.csv")
    make_data.write_breast_cancer_parquet(tmp_path / "breast_cancer.parquet")
    assert (tmp_path / "diabetes.csv").read_bytes() == (EXAMPLES / "diabetes.csv").read_bytes()
    written = pq.read_table(tmp_path / "breast_cancer.parquet")
    committed = pq.read_table(EXAMPLES / "breast_cancer.parquet")
    assert written.schema == committed.schema
    for name in committed.column_names:
        np.testing.assert_array_equal(written[name].to_numpy(), committed[name].to_numpy())
