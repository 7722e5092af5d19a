"""In one process the distributed pieces are no-ops that change nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import Subset, TensorDataset

from stoker.checkpoint import export_safetensors
from stoker.config import DistributedConfig
from stoker.data.samplers import EpochRandomSampler
from stoker.distributed.env import RankInfo
from stoker.distributed.guards import (
    AgreedStop,
    Watchdog,
    _is_collective_failure,
    check_same_data,
)
from stoker.distributed.runtime import Distributed
from stoker.distributed.sharding import rank_share
from stoker.train.resume import PlainWeights


def one_process() -> Distributed:
    return Distributed(RankInfo(), timeout_s=5)


def test_one_process_collectives_return_the_value_itself():
    dist = one_process()
    assert dist.gather({"a": 1}) == [{"a": 1}]
    assert dist.all_gather(3) == [3]
    assert dist.broadcast("x") == "x"
    assert dist.control_sum([1, 0]) == [1, 0]
    model = torch.nn.Linear(2, 2)
    assert dist.wrap(model, DistributedConfig(), device=torch.device("cpu")) is model
    assert dist.no_sync(model) is None
    assert isinstance(dist.weights_io(DistributedConfig(strategy="fsdp")), PlainWeights)
    check_same_data(dist, length=10, digest="abc")  # nothing to compare with: no error


def test_rank_share_is_the_whole_dataset_in_one_process():
    data = TensorDataset(torch.arange(10))
    assert rank_share(data) is data


def test_agreed_stop_acts_only_on_what_the_ranks_agreed():
    stop = AgreedStop()
    stop.signal_name = "SIGTERM"
    assert stop.local and not stop.requested
    stop.agreed = True
    assert stop.requested


@pytest.mark.parametrize(
    ("error", "collective"),
    [
        (
            RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer"),
            True,
        ),
        (RuntimeError("Timed out waiting 3000ms for recv operation to complete"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 2x2)"), False),
        (ValueError("gloo"), False),
    ],
)
def test_only_collective_failures_are_explained_as_such(error, collective):
    assert _is_collective_failure(error) is collective


def test_unshuffled_sampler_splits_in_order_across_ranks():
    shares = [list(EpochRandomSampler(10, shuffle=False, rank=r, world_size=3)) for r in range(3)]
    assert shares == [[0, 3, 6, 9], [1, 4, 7, 0], [2, 5, 8, 1]]


def test_exported_whole_state_stores_tied_tensors_once(tmp_path):
    shared = torch.randn(4, 3)
    state = {"embed.weight": shared, "head.weight": shared, "head.bias": torch.zeros(4)}
    export_safetensors(torch.nn.Module(), tmp_path / "m.safetensors", state=state)
    loaded = load_file(tmp_path / "m.safetensors")
    assert set(loaded) == {"embed.weight", "head.bias"}
    assert torch.equal(loaded["embed.weight"], shared)


def test_validation_share_is_a_strided_subset_under_two_ranks(monkeypatch):
    import stoker.distributed.sharding as sharding

    monkeypatch.setattr(sharding, "rank_and_world_size", lambda: (1, 2))
    share = rank_share(TensorDataset(torch.arange(7)))
    assert isinstance(share, Subset)
    assert list(share.indices) == [1, 3, 5]


def test_a_sampler_warns_when_an_epoch_starts_again_without_set_epoch(caplog):
    sampler = EpochRandomSampler(8, seed=0)
    first = list(sampler)
    with pytest.warns(UserWarning, match="call set_epoch"):
        again = list(sampler)
    assert again == first  # what the warning is about: the same order again
    sampler.set_epoch(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sorted(sampler) == list(range(8))  # a new epoch: no warning


def test_the_loader_moves_to_the_next_epoch_by_itself(toy_classification):
    """stoker's loader cannot repeat an epoch by accident: each full pass advances it."""
    from stoker.data.loader import build_loader

    x, y = toy_classification
    loader = build_loader(TensorDataset(x, y), batch_size=64, shuffle=True, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = torch.cat([batch[1] for batch in loader])
        second = torch.cat([batch[1] for batch in loader])
    assert loader.epoch == 2
    assert not torch.equal(first, second)


def test_a_closed_watchdog_has_ended_its_thread():
    # The thread holds the process groups: still running, they would outlive the run.
    watchdog = Watchdog(Distributed(RankInfo(rank=1, world_size=2), timeout_s=600))
    watchdog.arm("epoch 1, batch 1")
    thread = watchdog._thread
    assert thread is not None and thread.is_alive()
    watchdog.close()
    assert not thread.is_alive()
    assert watchdog._thread is None


def test_closing_lets_go_of_the_groups_even_when_torch_has_none():
    dist = Distributed(RankInfo(rank=0, world_size=2), timeout_s=5)
    dist.control, dist.saves = object(), object()
    dist.close()  # no default group here: nothing to destroy, but nothing kept either
    assert dist.control is None and dist.saves is None
