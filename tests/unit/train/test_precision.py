"""fp16 on a machine without CUDA: an error with the fix, unless the CPU was asked for."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import stoker
from stoker.config import validate_config
from stoker.data import device as device_module
from stoker.errors import ConfigError
from stoker.train.precision import build_precision

CPU = torch.device("cpu")


def _train(**train: object):
    return validate_config({"train": train}, source="test").train


def test_fp16_on_a_cpu_the_run_did_not_ask_for_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        build_precision(_train(precision="fp16"), CPU)
    assert info.value.exit_code == 2
    assert "train.precision=fp16: float16 autocast and loss scaling need a CUDA device" in str(
        info.value
    )
    assert "set train.precision=bf16" in info.value.hint and "train.device=cpu" in info.value.hint


def test_fp16_on_a_cpu_asked_for_by_name_runs_after_a_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="stoker"):
        precision = build_precision(_train(precision="fp16", device="cpu"), CPU)
    assert precision.scaling and precision.dtype is torch.float16
    assert "train.precision=fp16 on the CPU runs float16 in software" in caplog.text


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_other_precisions_on_the_cpu_build_quietly(name, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="stoker"):
        precision = build_precision(_train(precision=name), CPU)
    assert precision.name == name and not precision.scaling and caplog.text == ""


def test_fit_with_fp16_and_no_gpu_stops_before_training(tmp_path, monkeypatch) -> None:
    # As on a machine without a GPU, wherever the test runs: auto resolves to the CPU.
    monkeypatch.setattr(device_module.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(device_module, "_mps_available", lambda: False)
    generator = torch.Generator().manual_seed(0)
    data = (
        torch.randn(16, 4, generator=generator),
        torch.randint(0, 2, (16,), generator=generator),
    )
    with pytest.raises(ConfigError, match="need a CUDA device") as info:
        stoker.fit(nn.Linear(4, 2), data, precision="fp16", progress="quiet", run_dir=tmp_path)
    assert "precision='bf16'" in info.value.hint
    assert not (tmp_path / "metrics.jsonl").exists()


def _stoker(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # No GPU visible to the child, so `auto` is the CPU here and on a GPU machine alike.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env=env,
    )


def test_cli_train_with_fp16_and_no_gpu_exits_2_with_the_fix(tmp_path) -> None:
    (tmp_path / "tiny.csv").write_text("a,b,y\n0.1,0.2,0\n0.3,0.1,1\n0.5,0.5,0\n0.9,0.2,1\n")
    (tmp_path / "tiny.yaml").write_text(
        "model: {name: mlp, args: {in_features: 2, out_features: 2, hidden: [4]}}\n"
        "data: {train: {name: csv, args: {path: tiny.csv, target: y}}}\n"
        "loader: {batch_size: 2}\n"
        "train: {epochs: 1}\n"
    )
    done = _stoker("train", "tiny.yaml", "train.precision=fp16", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(
        "stoker: error: train.precision=fp16: float16 autocast and loss scaling need a CUDA"
    )
    assert "fix: set train.precision=bf16" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.glob("runs/*/metrics.jsonl"))  # nothing trained


def test_the_doctors_compute_measurement_refuses_fp16_on_a_cpu_too() -> None:
    """`stoker doctor` and `stoker explain` build the run's precision the same way."""
    from stoker.observe.stages import measure_compute

    config = validate_config({"train": {"precision": "fp16"}}, source="test")
    batch = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(ConfigError, match="train.precision=fp16"):
        measure_compute(
            nn.Linear(3, 2), batch, nn.CrossEntropyLoss(), config=config, device=CPU, seconds=0.1
        )
