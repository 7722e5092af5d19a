"""Tests for stoker.data.samplers across ranks, and mid-epoch resume of the samplers."""

from __future__ import annotations

import itertools

import pytest
import torch

from stoker.data.samplers import EpochRandomSampler, epoch_seed, rank_and_world_size, rank_slice
from stoker.data.weighted import EpochWeightedSampler
from stoker.errors import ConfigError


def flat(lists) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def test_ranks_take_disjoint_slices_of_one_permutation() -> None:
    full = list(EpochRandomSampler(12, seed=5))
    shares = [list(EpochRandomSampler(12, seed=5, rank=r, world_size=3)) for r in range(3)]
    assert shares == [full[0::3], full[1::3], full[2::3]]
    assert sorted(flat(shares)) == list(range(12))
    assert [len(EpochRandomSampler(12, rank=r, world_size=3)) for r in range(3)] == [4, 4, 4]


def test_uneven_ranks_are_padded_or_dropped() -> None:
    full = list(EpochRandomSampler(10, seed=1))
    padded = [list(EpochRandomSampler(10, seed=1, rank=r, world_size=4)) for r in range(4)]
    # 10 -> 12: the first two indices of the permutation are repeated at the end.
    extended = full + full[:2]
    assert padded == [extended[r::4] for r in range(4)]
    assert [len(p) for p in padded] == [3, 3, 3, 3]
    assert set(flat(padded)) == set(range(10))

    dropped = [
        list(EpochRandomSampler(10, seed=1, rank=r, world_size=4, drop_last=True)) for r in range(4)
    ]
    assert dropped == [full[:8][r::4] for r in range(4)]
    taken = flat(dropped)
    assert len(taken) == len(set(taken)) == 8
    assert len(EpochRandomSampler(10, rank=3, world_size=4, drop_last=True)) == 2


def test_rank_slice_repeats_the_head_when_shorter_than_world() -> None:
    order = torch.tensor([7, 8])
    assert [rank_slice(order, r, 5, drop_last=False).tolist() for r in range(5)] == [
        [7],
        [8],
        [7],
        [8],
        [7],
    ]


def test_weighted_with_replacement_draws_per_rank() -> None:
    weights = torch.tensor([1.0, 2.0, 3.0, 4.0])
    single = EpochWeightedSampler(weights, num_samples=9, seed=2)
    assert (
        list(single)
        == torch.multinomial(
            weights, 9, True, generator=torch.Generator().manual_seed(epoch_seed(2, 0))
        ).tolist()
    )
    ranks = [
        EpochWeightedSampler(weights, num_samples=9, seed=2, rank=r, world_size=2) for r in range(2)
    ]
    draws = [list(s) for s in ranks]
    assert [len(d) for d in draws] == [5, 5] and [len(s) for s in ranks] == [5, 5]
    assert draws[0] != draws[1]
    again = EpochWeightedSampler(weights, num_samples=9, seed=2, rank=1, world_size=2)
    assert list(again) == draws[1]


def test_weighted_without_replacement_is_disjoint_across_ranks() -> None:
    weights = torch.ones(10)
    shares = [
        list(EpochWeightedSampler(weights, num_samples=8, replacement=False, rank=r, world_size=2))
        for r in range(2)
    ]
    assert [len(s) for s in shares] == [4, 4]
    assert not set(shares[0]) & set(shares[1])
    assert len(set(shares[0] + shares[1])) == 8


@pytest.mark.parametrize("world_size", [1, 3])
def test_random_sampler_resumes_mid_epoch(world_size: int) -> None:
    sampler = EpochRandomSampler(20, seed=4, rank=world_size - 1, world_size=world_size)
    sampler.set_epoch(2)
    expected = list(sampler)
    iterator = iter(sampler)
    with pytest.warns(UserWarning, match="call set_epoch"):  # reading epoch 2 again, on purpose
        head = [next(iterator) for _ in range(3)]
    state = sampler.state_dict()
    assert state == {"seed": 4, "epoch": 2, "samples_yielded": 3, "world_size": world_size}

    fresh = EpochRandomSampler(20, seed=0, rank=world_size - 1, world_size=world_size)
    fresh.load_state_dict(state)
    assert fresh.indices().tolist() == expected[3:]
    assert head + list(fresh) == expected
    assert fresh.samples_yielded == len(expected)
    # A finished pass leaves no position; the next pass of the epoch starts over.
    assert fresh.state_dict() == {"seed": 4, "epoch": 2}
    with pytest.warns(UserWarning, match="call set_epoch"):
        assert list(fresh) == expected


def test_weighted_sampler_resumes_mid_epoch() -> None:
    sampler = EpochWeightedSampler(torch.arange(1.0, 9.0), num_samples=16, seed=3)
    expected = list(sampler)
    iterator = iter(sampler)
    with pytest.warns(UserWarning, match="call set_epoch"):  # reading epoch 0 again, on purpose
        head = [next(iterator) for _ in range(10)]
    fresh = EpochWeightedSampler(torch.arange(1.0, 9.0), num_samples=16)
    fresh.load_state_dict(sampler.state_dict())
    assert head + list(fresh) == expected


def test_new_epoch_forgets_a_loaded_position() -> None:
    sampler = EpochRandomSampler(10, seed=1)
    sampler.load_state_dict({"seed": 1, "epoch": 0, "samples_yielded": 4})
    sampler.set_epoch(0)  # same epoch (as EpochLoader does on load): position kept
    assert len(sampler.indices()) == 6
    sampler.set_epoch(1)
    assert len(list(sampler)) == 10


def test_loading_a_position_from_another_world_size_fails() -> None:
    sampler = EpochRandomSampler(10, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="world_size=4, but this run has world_size=2"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "samples_yielded": 1, "world_size": 4})
    with pytest.raises(ConfigError, match="samples_yielded=9, but an epoch has 5"):
        sampler.load_state_dict({"seed": 0, "epoch": 0, "samples_yielded": 9, "world_size": 2})


def test_rank_defaults_come_from_torch_distributed(monkeypatch) -> None:
    assert rank_and_world_size() == (0, 1)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 2)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 4)
    assert rank_and_world_size() == (2, 4)
    assert rank_and_world_size(rank=0) == (0, 4)
    sampler = EpochRandomSampler(8)
    assert (sampler.rank, sampler.world_size, len(sampler)) == (2, 4, 2)


@pytest.mark.parametrize(
    ("rank", "world_size", "pattern"),
    [(2, 2, r"rank must be an int in \[0, 2\); got 2"), (0, 0, "world_size must be an int >= 1")],
)
def test_bad_rank_or_world_size(rank: int, world_size: int, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        EpochRandomSampler(4, rank=rank, world_size=world_size)
