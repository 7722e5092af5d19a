"""FSDP2 on CPU (gloo): sharded training reaches one process's weights, checkpoints each
rank's shard, resumes exactly and exports whole tensors.

The comparison is with one process of the 2 ranks' batch (in this process), as DDP's is
in test_equivalence.py: a DDP run here as well would cost a third launch of processes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from stoker.checkpoint import DamagedCheckpointError, load_checkpoint
from stoker_cli import run_cli

pytestmark = pytest.mark.distributed


def test_fsdp_trains_like_one_process_and_exports_whole_weights(write_config, run_stoker, tmp_path):
    config = write_config(
        data={"val_fraction": 0.2},
        train={"epochs": 2, "grad_accum_steps": 2},
        checkpoint={"enabled": True, "every_steps": 3, "keep_last": 10},
    )
    # The sharded run saves asynchronously (checkpoint.async_save); case.py's WatchSaves
    # slows each shard write by 0.5 s and checks at every step that each checkpoint with
    # a marker is whole, its shards included.
    watched, report = tmp_path / "async.yaml", tmp_path / "watch.json"
    spec = yaml.safe_load(config.read_text())
    spec["checkpoint"]["async_save"] = True
    args = {"checkpoints": str(tmp_path / "fsdp" / "checkpoints"), "report": str(report)}
    spec["callbacks"] = [
        {"name": f"{Path(__file__).with_name('case.py')}:WatchSaves", "args": args}
    ]
    watched.write_text(yaml.safe_dump(spec))
    result = run_stoker(
        "train",
        str(watched),
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

    # Checkpoints hold each rank's shard (torch.distributed.checkpoint), listed and hashed
    # in state.pt, inside the usual manifest + marker; no process gathered the whole model.
    checkpoints = tmp_path / "fsdp" / "checkpoints"
    folders = sorted(p.parent for p in checkpoints.glob("*/COMPLETE"))
    state = load_checkpoint(folders[-1])  # verified: marker, manifest, every byte
    files = state["model"]["sharded_weights"]["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not any(isinstance(v, torch.Tensor) for v in state["model"].values())
    # Steps ran while a save was written (a synchronous save blocks them: 0), a marked
    # checkpoint was whole whenever looked at (step 2's at step 4, at least: the save at
    # step 3 waited for it), and the save pending at the end was finished (step 4's).
    watch = json.loads(report.read_text())
    assert watch["steps"] >= 1 and "step-00000002" in watch["verified"]
    assert [f.name for f in folders] == ["step-00000002", "step-00000003", "step-00000004"]

    # Resumed on 2 processes from the mid-epoch checkpoint (the later ones taken away),
    # the run (saving synchronously) ends with the weights of the uninterrupted one, bit
    # for bit: the asynchronous saves wrote the state of their step, not a later one.
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp", resumed)
    mid = next(f for f in folders if load_checkpoint(f)["in_epoch"] is not None)
    for folder in folders[folders.index(mid) + 1 :]:
        shutil.rmtree(resumed / "checkpoints" / folder.name)
    result = run_stoker(
        "train", str(config), "distributed.strategy=fsdp", "--nproc", "2",
        "--resume", str(resumed), "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    got = load_file(resumed / "model.safetensors")
    for name, tensor in fsdp.items():
        assert torch.equal(got[name], tensor), name

    # A damaged shard is named before anything loads. (Imported here: FSDP's module
    # imports torch.distributed.checkpoint, ~1 s of CPU at every xdist worker's collection.)
    from stoker.distributed.fsdp import ShardedWeights

    damaged = tmp_path / "damaged"
    shutil.copytree(resumed, damaged)
    latest = sorted(p.parent for p in (damaged / "checkpoints").glob("*/COMPLETE"))[-1]
    with (latest / "shards" / "__1_0.distcp").open("r+b") as shard:
        shard.write(b"\x00")
    with pytest.raises(DamagedCheckpointError, match="__1_0.distcp was altered"):
        ShardedWeights(_OneRank(), checkpoints=latest.parent).load(
            None, None, load_checkpoint(latest)["model"], {}
        )


class _OneRank:
    """The collectives of a world of one, for checking shards outside a distributed run."""

    rank, world_size = 0, 1

    def all_gather(self, value):
        return [value]
