"""`stoker train` on a model that does not fit its data: one message, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stoker_cli import run_cli

MODELS = '''
from torch import nn


class Net(nn.Module):
    """Written for 20 features; the data has 64."""

    def __init__(self, in_features: int = 20, out_features: int = 10) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU())
        self.head = nn.Linear(32, out_features)

    def forward(self, x):
        return self.head(self.encoder(x))
'''

CONFIG = """
model: {name: "models.py:Net", args: {in_features: 20, out_features: 10}}
data: {train: {name: npy, args: {path: {features: features.npy, labels: labels.npy}}}}
loader: {batch_size: 16}
train: {epochs: 1, max_steps: 1}
checkpoint: {enabled: false}
tracking: {tensorboard: false}
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    # 32 samples of 64 features (numpy only: no scikit-learn to import for the data).
    np.save(tmp_path / "features.npy", np.zeros((32, 64), dtype=np.float32))
    np.save(tmp_path / "labels.npy", np.arange(32, dtype=np.int64) % 10)
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "config.yaml").write_text(CONFIG)
    return tmp_path


def train(project: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "stoker.cli.main", "train", "config.yaml"]
    command += ["--run-dir", str(project / "run"), "--quiet", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=project)


def test_a_layer_that_does_not_fit_ends_in_one_message(project: Path) -> None:
    # In-process: the same main and stderr; the --debug test below is the real process.
    done = run_cli("train", "config.yaml", "--run-dir", project / "run", "--quiet", cwd=project)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("stoker: error:")]
    assert errors == [
        "stoker: error: model.encoder.0 (Linear) cannot take its input: got [16, 64] float32, "
        "expects a last dimension of in_features=20 "
        "(RuntimeError: mat1 and mat2 shapes cannot be multiplied (16x64 and 20x32))"
    ]
    assert "  fix: set model.args.in_features=64" in done.stderr.splitlines()


def test_debug_shows_the_traceback_down_to_the_layer(project: Path) -> None:
    done = train(project, "--debug")
    assert done.returncode != 0
    assert "Traceback (most recent call last)" in done.stderr
    assert "torch/nn/modules/linear.py" in done.stderr  # the original, as the cause
    assert "stoker.errors.ModelError: model.encoder.0 (Linear)" in done.stderr
