"""FSDP2 on CPU (gloo): sharded training reaches one process's weights, saves whole tensors.

The comparison is with one process of the 2 ranks' batch (in this process), as DDP's is
in test_equivalence.py: a DDP run here as well would cost a third launch of processes.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from stoker_cli import run_cli

pytestmark = pytest.mark.distributed


def test_fsdp_trains_like_one_process_and_exports_whole_weights(write_config, run_stoker, tmp_path):
    config = write_config(
        data={"val_fraction": 0.2},
        train={"epochs": 2, "grad_accum_steps": 2},
        checkpoint={"enabled": True, "every_steps": 3},
    )
    result = run_stoker(
        "train",
        str(config),
        "distributed.strategy=fsdp",
        "--nproc",
        "2",
        "--run-dir",
        str(tmp_path / "fsdp"),
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    # One process with both ranks' batch (one intra-op thread, as the ranks have).
    one = run_cli(
        "train", config, "loader.batch_size=64", "--run-dir", tmp_path / "one", "--quiet",
        threads=1,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    fsdp = load_file(tmp_path / "fsdp" / "model.safetensors")
    single = load_file(tmp_path / "one" / "model.safetensors")

    assert fsdp.keys() == single.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name, tensor in single.items():
        assert fsdp[name].shape == tensor.shape  # whole tensors, not one rank's shard
        torch.testing.assert_close(fsdp[name], tensor, rtol=1e-5, atol=1e-6)

    # The checkpoint holds whole tensors too, loadable into the plain model.
    checkpoints = sorted((tmp_path / "fsdp" / "checkpoints").glob("step-*/state.pt"))
    state = torch.load(checkpoints[-1], weights_only=True)
    assert state["model"]["0.weight"].shape == (32, 8)
