"""Shared set-up for the tests that start several processes through torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CASE = Path(__file__).with_name("case.py")


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a small run config using case.py's components; returns its path."""

    def write(*, dataset: str = "samples", **sections: dict) -> Path:
        config = {
            "seed": 0,
            "model": {"name": f"{CASE}:model"},
            "data": {"train": {"name": f"{CASE}:{dataset}"}},
            "loader": {"batch_size": 32},
            "loss": {"name": "cross_entropy"},
            "optim": {"name": "sgd", "lr": 0.1},
            "train": {"epochs": 2, "device": "cpu", "log_every_steps": 1},
            "checkpoint": {"enabled": False},
        }
        for section, values in sections.items():
            config.setdefault(section, {}).update(values)
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write


@pytest.fixture
def run_stoker():
    """Run the stoker CLI as a user would; returns the completed process."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 180):
        environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        return subprocess.run(
            [sys.executable, "-m", "stoker", *args],
            capture_output=True,
            text=True,
            env=environ,
            timeout=timeout,
        )

    return run
