"""FSDP2 on CPU (gloo): sharded training reaches DDP's weights and saves whole tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.distributed


def test_fsdp_trains_like_ddp_and_exports_whole_weights(write_config, run_stoker, tmp_path):
    config = write_config(
        data={"val_fraction": 0.2},
        train={"epochs": 2, "grad_accum_steps": 2},
        checkpoint={"enabled": True, "every_steps": 3},
    )
    runs = {}
    for strategy in ("ddp", "fsdp"):
        run_dir = tmp_path / strategy
        result = run_stoker(
            "train",
            str(config),
            f"distributed.strategy={strategy}",
            "--nproc",
            "2",
            "--run-dir",
            str(run_dir),
            "--quiet",
        )
        assert result.returncode == 0, result.stderr
        runs[strategy] = load_file(run_dir / "model.safetensors")

    assert runs["fsdp"].keys() == runs["ddp"].keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, tensor in runs["ddp"].items():
        assert runs["fsdp"][name].shape == tensor.shape  # whole tensors, not one rank's shard
        torch.testing.assert_close(runs["fsdp"][name], tensor, rtol=1e-5, atol=1e-6)

    # The checkpoint holds whole tensors too, loadable into the plain model.
    checkpoints = sorted((tmp_path / "fsdp" / "checkpoints").glob("step-*/state.pt"))
    state = torch.load(checkpoints[-1], weights_only=True)
    assert state["model"]["0.weight"].shape == (32, 8)
