"""Tests for stoker.data.samplers: per-epoch seeded random and weighted samplers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from stoker.data import EpochRandomSampler, EpochWeightedSampler, balanced_weights, epoch_seed
from stoker.errors import ConfigError, DataError


def test_random_sampler_is_a_permutation_fixed_by_seed_and_epoch() -> None:
    sampler = EpochRandomSampler(50, seed=3)
    first = list(sampler)
    assert sorted(first) == list(range(50)) and len(sampler) == 50
    with pytest.warns(UserWarning, match="call set_epoch"):
        assert list(sampler) == first  # same epoch, same order
    sampler.set_epoch(1)
    second = list(sampler)
    assert second != first
    torch.manual_seed(123)  # the global RNG plays no part
    fresh = EpochRandomSampler(50, seed=3)
    fresh.load_state_dict({"seed": 3, "epoch": 1})
    assert list(fresh) == second
    assert fresh.state_dict() == {"seed": 3, "epoch": 1}
    assert list(EpochRandomSampler(50, seed=4)) != first
    assert torch.equal(fresh.indices(), torch.tensor(second))


def test_epoch_seed_mixes_its_inputs() -> None:
    seeds = {epoch_seed(s, e, stream=k) for s in range(4) for e in range(4) for k in range(2)}
    assert len(seeds) == 32
    assert all(0 <= s < 2**63 for s in seeds)
    assert epoch_seed(-1, 0) == epoch_seed(-1, 0)


def test_weighted_sampler_draws_by_weight_per_epoch() -> None:
    weights = torch.tensor([0.0, 1.0, 0.0, 3.0])
    sampler = EpochWeightedSampler(weights, num_samples=4000, seed=1)
    draws = torch.tensor(list(sampler))
    assert len(draws) == 4000 and len(sampler) == 4000
    assert set(draws.tolist()) == {1, 3}
    assert 0.70 < (draws == 3).float().mean().item() < 0.80
    again = EpochWeightedSampler(weights, num_samples=4000, seed=1)
    assert list(again) == draws.tolist()
    again.set_epoch(1)
    assert list(again) != draws.tolist()
    assert again.state_dict() == {"seed": 1, "epoch": 1}
    assert len(EpochWeightedSampler([1.0, 2.0])) == 2


def test_weighted_without_replacement() -> None:
    sampler = EpochWeightedSampler([1.0, 1.0, 0.0, 1.0], num_samples=3, replacement=False)
    assert sorted(sampler) == [0, 1, 3]
    with pytest.raises(ConfigError, match=r"loader.num_samples=4 .* only 3"):
        EpochWeightedSampler([1.0, 1.0, 0.0, 1.0], num_samples=4, replacement=False)


@pytest.mark.parametrize(
    ("weights", "pattern"),
    [
        ([1.0, math.nan, 2.0, math.inf], r"index 1 is nan.*2 non-finite"),
        (np.array([1.0, 2.0, -0.5]), r"index 2 is -0.5"),
        ([0.0, 0.0], "all 2 sampler weights are zero"),
        (torch.ones(2, 3), r"shape \(2, 3\)"),
        ([], "empty"),
        (["a", "b"], "do not convert"),
    ],
)
def test_bad_weights_are_named(weights, pattern: str) -> None:
    with pytest.raises(DataError, match=pattern):
        EpochWeightedSampler(weights)


def test_weights_must_match_dataset_length() -> None:
    with pytest.raises(DataError, match="3 entries but the dataset has 5"):
        EpochWeightedSampler([1.0, 1.0, 1.0], dataset_len=5)


def test_balanced_weights() -> None:
    weights = balanced_weights(np.array([0, 0, 0, 1, 2, 2]))
    assert torch.allclose(
        weights, torch.tensor([1 / 3, 1 / 3, 1 / 3, 1.0, 0.5, 0.5], dtype=torch.float64)
    )
    with pytest.raises(DataError, match="argmax"):
        balanced_weights(torch.eye(3))


def test_block_shuffle_sees_every_sample_once_and_reads_few_blocks_at_a_time() -> None:
    from stoker.data.samplers import BlockShuffleSampler

    offsets = [0, 10, 25, 40, 41, 60, 80]  # six blocks of uneven size, 80 samples
    sampler = BlockShuffleSampler(offsets, window=2, seed=4)
    order = list(sampler)
    assert sorted(order) == list(range(80))
    block_of = torch.bucketize(torch.tensor(order), torch.tensor(offsets[1:]), right=True)
    # Within each stretch of samples drawn from one window, at most 2 blocks appear.
    sizes = [10, 15, 15, 1, 19, 20]
    start = 0
    seen_blocks = []
    while start < 80:
        window_blocks = set(block_of[start : start + 1].tolist())
        end = start
        while end < 80 and len(window_blocks | {int(block_of[end])}) <= 2:
            window_blocks.add(int(block_of[end]))
            end += 1
        seen_blocks.append(window_blocks)
        assert end - start == sum(sizes[b] for b in window_blocks)
        start = end
    sampler.set_epoch(1)
    assert list(sampler) != order  # a new order each epoch
    with pytest.warns(UserWarning, match="call set_epoch"):  # epoch 1 again, on purpose
        assert sorted(sampler) == list(range(80))


def test_parquet_gets_the_block_shuffle_by_default(tmp_path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from stoker.data.loader import build_loader
    from stoker.data.parquet import ParquetDataset
    from stoker.data.samplers import BlockShuffleSampler

    table = pa.table({"a": list(range(100)), "label": [i % 2 for i in range(100)]})
    pq.write_table(table, tmp_path / "t.parquet", row_group_size=20)
    loader = build_loader(
        ParquetDataset(tmp_path / "t.parquet", target="label"), batch_size=10, shuffle=True
    )
    assert isinstance(loader.sampler, BlockShuffleSampler)
    values = torch.cat([features[:, 0] for features, _ in loader])
    assert sorted(values.long().tolist()) == list(range(100))


@pytest.mark.parametrize("count", [1, 1000, 70_000, 3_787_878])
def test_int32_orders_are_the_int64_permutations(count: int) -> None:
    """Epoch orders are int32 to halve their memory; the permutation must not change,
    or a run resumed from an older checkpoint would see another order."""
    from stoker.data.samplers import _generator, index_dtype

    sampler = EpochRandomSampler(count, seed=7)
    sampler.set_epoch(2)
    order = sampler.epoch_indices()
    assert order.dtype == torch.int32 == index_dtype(count)
    assert torch.equal(order.long(), torch.randperm(count, generator=_generator(7, 2)))
    in_order = EpochRandomSampler(count, shuffle=False).epoch_indices()
    assert in_order.dtype == torch.int32 and int(in_order[-1]) == count - 1
    assert index_dtype(2**31) == torch.long and index_dtype(2**31 - 1) == torch.int32


def test_block_shuffle_fills_the_order_as_joining_the_windows_would() -> None:
    """The order is built in place; it is the same as the windows' shuffles joined."""
    from stoker.data.samplers import BlockShuffleSampler, _generator

    offsets = [0, 10, 25, 40, 41, 60, 80, 95]
    sampler = BlockShuffleSampler(offsets, window=3, seed=5)
    sampler.set_epoch(3)
    generator = _generator(5, 3)
    blocks = torch.randperm(len(offsets) - 1, generator=generator).tolist()
    pieces = []
    for first in range(0, len(blocks), 3):
        members = torch.cat(
            [torch.arange(offsets[b], offsets[b + 1]) for b in blocks[first : first + 3]]
        )
        pieces.append(members[torch.randperm(len(members), generator=generator)])
    order = sampler.epoch_indices()
    assert order.dtype == torch.int32
    assert order.tolist() == torch.cat(pieces).tolist()


def test_a_pass_across_list_slices_is_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """The order becomes Python ints a slice at a time; across slices the pass, its count
    and a resume from it are exact."""
    from itertools import islice

    from stoker.data import samplers

    monkeypatch.setattr(samplers, "_LIST_SLICE", 7)
    sampler = EpochRandomSampler(50, seed=2)
    expected = sampler.epoch_indices().tolist()
    passing = iter(sampler)
    head = list(islice(passing, 20))
    assert head == expected[:20] and sampler.samples_yielded == 20
    resumed = EpochRandomSampler(50, seed=2)
    resumed.load_state_dict(sampler.state_dict())
    assert list(resumed) == expected[20:] and resumed.samples_yielded == 50
    assert list(passing) == expected[20:]
