"""Shared set-up for the tests that start several processes through torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from filelock import FileLock

CASE = Path(__file__).with_name("case.py")


def _write_config(path: Path, *, dataset: str = "samples", **sections: dict) -> Path:
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
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def write_config(tmp_path: Path):
    """Write a small run config using case.py's components; returns its path."""

    def write(*, dataset: str = "samples", **sections: dict) -> Path:
        return _write_config(tmp_path / "config.yaml", dataset=dataset, **sections)

    return write


def _run_stoker(*args: str, env: dict[str, str] | None = None, timeout: float = 180):
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "stoker", *args],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
    )


@pytest.fixture
def run_stoker():
    """Run the stoker CLI as a user would; returns the completed process."""
    return _run_stoker


@pytest.fixture(scope="session")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(config, run_dir)``: an uninterrupted 2-rank run of 12 epochs with checkpoints.

    test_stop.py (stopped by SIGTERM, then resumed) and test_elastic.py (a rank killed,
    the group restarted) must both end with this run's weights. A launch of 2 ranks costs
    ~14 s of CPU, so the run is made once per session: under pytest-xdist by whichever
    worker asks first, the other waiting on a lock (the session's temporary folder is
    shared by its workers, and new in every session). The tests only read it.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "distributed-clean-run"
    config, run_dir = folder / "config.yaml", folder / "clean"
    with FileLock(f"{folder}.lock"):
        if not (folder / "done").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed attempt left
            folder.mkdir()
            _write_config(
                config, train={"epochs": 12}, checkpoint={"enabled": True, "every_steps": 2}
            )
            done = _run_stoker(
                "train", str(config), "--nproc", "2", "--run-dir", str(run_dir), "--quiet"
            )
            assert done.returncode == 0, done.stderr
            (folder / "done").touch()
    return config, run_dir
