"""checkpoint.async_save: shards written in the background, failures raised for people.

The 2-process run is in tests/distributed/test_fsdp.py; here the pieces, in one process.
"""

from __future__ import annotations

import errno
import logging
from concurrent.futures import Future

import pytest
import torch

from stoker.config import DistributedConfig
from stoker.distributed.env import RankInfo
from stoker.distributed.runtime import Distributed
from stoker.errors import CheckpointError
from stoker.train.resume import PlainWeights


class _OneRank:
    rank, world_size = 0, 1

    def all_gather(self, value):
        return [value]


def test_the_shards_written_are_as_they_were_when_async_save_returned(tmp_path):
    import torch.distributed.checkpoint as dcp

    from stoker.checkpoint.sharded import list_shards, shards_written, start_writing_shards

    weights = torch.arange(1_000_000, dtype=torch.float32)
    with pytest.warns(UserWarning):  # DCP: no process group, so one process writes all
        future = start_writing_shards(tmp_path, {"w": weights}, group=None)
        weights.add_(1.0)  # the next optimizer step, before the write is done
        shards_written(future)
        back = {"w": torch.empty_like(weights)}
        dcp.load(back, checkpoint_id=tmp_path / "shards")
    assert torch.equal(back["w"], torch.arange(1_000_000, dtype=torch.float32))
    assert ".metadata" in list_shards(tmp_path)


def test_a_failed_write_raises_the_oserror_behind_dcps_checkpoint_exception(tmp_path):
    import torch.distributed.checkpoint as dcp

    from stoker.checkpoint.sharded import shards_written, start_writing_shards, write_shards

    (tmp_path / "shards" / "__0_0.distcp").mkdir(parents=True)  # the shard cannot be opened
    with pytest.warns(UserWarning), pytest.raises(IsADirectoryError) as raised:
        shards_written(start_writing_shards(tmp_path, {"w": torch.ones(3)}, group=None))
    assert isinstance(raised.value.__cause__, dcp.CheckpointException)
    with pytest.warns(UserWarning), pytest.raises(IsADirectoryError):
        write_shards(tmp_path, {"w": torch.ones(3)})  # the synchronous save, the same error


def _failed_write() -> Future:
    from torch.distributed.checkpoint import CheckpointException

    future: Future = Future()
    full = OSError(errno.ENOSPC, "No space left on device")
    future.set_exception(CheckpointException("write", {1: (full, None)}))
    return future


def test_a_failed_background_write_raises_the_disk_full_error_a_synchronous_save_gives(tmp_path):
    from stoker.distributed.fsdp import ShardedWeights

    weights = ShardedWeights(_OneRank(), async_save=True)
    weights._writing = (tmp_path / ".tmp-step-00000003-ab12", _failed_write())
    assert weights.pending
    with pytest.raises(CheckpointError, match="disk full") as raised:
        weights.settle(None)  # a rank that writes no state.pt: waits for its own shards
    assert "checkpoint.keep_last" in str(raised.value) and not weights.pending


def test_rank_0_raises_its_checkpointers_error_and_every_rank_the_first(tmp_path):
    from stoker.distributed.fsdp import ShardedWeights

    class Failing:
        def wait(self):
            raise CheckpointError("Could not write checkpoint step-3: disk full.", hint="free")

    class TwoRanks(_OneRank):
        def all_gather(self, value):
            return [value, ("rank 1's own message", None)]

    weights = ShardedWeights(TwoRanks(), async_save=True)
    weights._writing = (tmp_path, _failed_write())
    with pytest.raises(CheckpointError, match="step-3: disk full") as raised:
        weights.settle(Failing())
    assert raised.value.hint == "free"


def test_async_save_outside_fsdp_is_ignored_with_a_warning(caplog):
    dist = Distributed(RankInfo(), timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="stoker"):
        weights = dist.weights_io(DistributedConfig(), async_save=True)
    assert isinstance(weights, PlainWeights) and not weights.pending
    assert "checkpoint.async_save applies to FSDP runs only" in caplog.text
