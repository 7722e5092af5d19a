"""Tests for stoker.data.bucketing: length-bucketed batches, their padding, ranks and resume."""

from __future__ import annotations

import pytest
import torch

from stoker.data.bucketing import LengthBucketBatchSampler
from stoker.errors import ConfigError, DataError


def varied_lengths(n: int = 1000) -> torch.Tensor:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(0))


def test_every_index_once_per_epoch_in_full_batches() -> None:
    sampler = LengthBucketBatchSampler(varied_lengths(1003), batch_size=16, seed=1)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 63
    assert sorted(i for b in batches for i in b) == list(range(1003))
    assert sorted(len(b) for b in batches)[:2] == [11, 16]  # one short batch, the rest full
    dropped = LengthBucketBatchSampler(varied_lengths(1003), batch_size=16, drop_last=True)
    assert len(list(dropped)) == len(dropped) == 62
    assert all(len(b) == 16 for b in dropped)


def test_without_shuffle_buckets_are_sorted_in_order() -> None:
    lengths = [5, 1, 4, 2, 3, 6, 8, 7, 9]
    sampler = LengthBucketBatchSampler(
        lengths, batch_size=2, bucket_size_multiplier=2, shuffle=False
    )
    assert list(sampler) == [[1, 3], [2, 0], [4, 5], [7, 6], [8]]


def test_batches_are_seeded_per_epoch() -> None:
    lengths = varied_lengths(200)
    first = list(LengthBucketBatchSampler(lengths, batch_size=8, seed=3))
    assert list(LengthBucketBatchSampler(lengths, batch_size=8, seed=3)) == first
    other = LengthBucketBatchSampler(lengths, batch_size=8, seed=3)
    other.set_epoch(1)
    assert list(other) != first
    assert list(LengthBucketBatchSampler(lengths, batch_size=8, seed=4)) != first


def test_bucketing_pads_less_than_random_batches() -> None:
    sampler = LengthBucketBatchSampler(varied_lengths(), batch_size=16, bucket_size_multiplier=20)
    stats = sampler.padding_stats()
    assert stats["tokens"] == int(varied_lengths().sum())
    assert stats["padding_fraction"] < 0.1 < 0.4 < stats["random_padding_fraction"]
    expected = 1 - stats["padded_tokens"] / stats["random_padded_tokens"]
    assert stats["saved_fraction"] == pytest.approx(expected) and stats["saved_fraction"] > 0.3
    lengths = [varied_lengths()[b] for b in sampler]
    padded = sum(int(t.max()) * len(t) for t in lengths)
    assert padded == stats["padded_tokens"]


def test_padding_stats_with_truncation_and_multiple() -> None:
    sampler = LengthBucketBatchSampler([1, 1, 8, 8], batch_size=2, shuffle=False)
    stats = sampler.padding_stats()
    assert (stats["tokens"], stats["padded_tokens"], stats["padding_fraction"]) == (18, 18, 0.0)
    stats = sampler.padding_stats(pad_to_multiple_of=8)
    assert stats["padded_tokens"] == 32 and stats["padding_fraction"] == (32 - 18) / 32
    stats = sampler.padding_stats(max_length=4)
    assert (stats["tokens"], stats["padded_tokens"]) == (10, 10)


def test_ranks_get_disjoint_batches_and_equal_counts() -> None:
    lengths = varied_lengths(100)  # 13 batches of 8 (the last one 4)
    full = list(LengthBucketBatchSampler(lengths, batch_size=8, seed=2))
    ranks = [
        list(LengthBucketBatchSampler(lengths, batch_size=8, seed=2, rank=r, world_size=3))
        for r in range(3)
    ]
    assert [len(r) for r in ranks] == [5, 5, 5]
    padded = full + full[:2]  # 13 -> 15: the first two batches repeat
    assert ranks == [padded[r::3] for r in range(3)]
    assert sorted(i for b in full for i in b) == list(range(100))
    assert sorted(i for r in ranks for b in r for i in b) == sorted(i for b in padded for i in b)

    dropped = [
        list(
            LengthBucketBatchSampler(
                lengths, batch_size=8, seed=2, rank=r, world_size=3, drop_last=True
            )
        )
        for r in range(3)
    ]
    assert [len(r) for r in dropped] == [4, 4, 4]
    flat = [i for r in dropped for b in r for i in b]
    assert len(flat) == len(set(flat)) == 96


def test_resume_mid_epoch_skips_what_was_yielded() -> None:
    sampler = LengthBucketBatchSampler(varied_lengths(300), batch_size=8, seed=5)
    sampler.set_epoch(3)
    expected = list(sampler)
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(7)]
    state = sampler.state_dict()
    assert state == {"epoch": 3, "batches_yielded": 7, "world_size": 1}
    fresh = LengthBucketBatchSampler(varied_lengths(300), batch_size=8, seed=5)
    fresh.load_state_dict(state)
    assert head + list(fresh) == expected
    assert fresh.batches_yielded == len(expected)
    assert list(fresh) == expected  # the next pass starts over


def test_bad_inputs_are_named() -> None:
    with pytest.raises(DataError, match="index 1 is -3"):
        LengthBucketBatchSampler([2, -3], batch_size=2)
    with pytest.raises(DataError, match=r"dtype torch\.float32"):
        LengthBucketBatchSampler(torch.ones(3), batch_size=2)
    with pytest.raises(ConfigError, match="batch_size must be an int >= 1; got 0"):
        LengthBucketBatchSampler([1, 2], batch_size=0)
    sampler = LengthBucketBatchSampler([1, 2, 3], batch_size=1)
    with pytest.raises(ConfigError, match="batches_yielded=9"):
        sampler.load_state_dict({"epoch": 0, "batches_yielded": 9})
