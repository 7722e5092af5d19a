"""Tests for stoker.data.loader: build_loader's fast paths, seeding and option checks."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from stoker.data import ArrayDataset, EpochLoader, build_loader, passthrough
from stoker.errors import ConfigError, DataError


def array_dataset(n: int = 100) -> ArrayDataset:
    return ArrayDataset(torch.arange(n, dtype=torch.float32).reshape(n, 1), torch.arange(n))


class NoPerSample(ArrayDataset):
    """Fails if the loader ever fetches one sample at a time."""

    def __getitem__(self, index: int):
        raise AssertionError("per-sample __getitem__ was called")


class NoPerSampleTensors(TensorDataset):
    def __getitem__(self, index: int):
        raise AssertionError("per-sample __getitem__ was called")


class RandomSamples(Dataset):
    """Samples drawn from torch, numpy and random: reproducible only if workers are seeded."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, torch.rand(()).item(), np.random.rand(), random.random()])


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10.0))


class Unsized(Dataset):
    def __getitem__(self, i: int) -> int:
        return i


def ids(loader: EpochLoader) -> list[list[int]]:
    return [batch[1].tolist() for batch in loader]


def test_batch_counts_and_last_batch_size() -> None:
    loader = build_loader(array_dataset(), batch_size=32)
    sizes = [len(x) for x, _ in loader]
    assert sizes == [32, 32, 32, 4] and len(loader) == 4
    dropped = build_loader(array_dataset(), batch_size=32, drop_last=True, shuffle=True)
    assert [len(y) for _, y in dropped] == [32, 32, 32] and len(dropped) == 3
    assert loader.batch_size == 32 and loader.returns_batches


def test_sequential_batches_equal_the_gather() -> None:
    x = torch.randn(10, 3)
    y = torch.arange(10) * 10
    loader = build_loader(TensorDataset(x, y), batch_size=4)
    batches = list(loader)
    assert isinstance(loader.dataset, ArrayDataset)
    assert loader.dataloader.collate_fn is passthrough
    assert [b[1].tolist() for b in batches] == [[0, 10, 20, 30], [40, 50, 60, 70], [80, 90]]
    assert torch.equal(batches[1][0], x[4:8])


def test_batched_fetch_never_calls_getitem() -> None:
    x, y = torch.randn(20, 2), torch.arange(20)
    for dataset in (NoPerSample(x, y), NoPerSampleTensors(x, y)):
        loader = build_loader(dataset, batch_size=8, shuffle=True, seed=1)
        batches = list(loader)
        order = torch.cat([b[1] for b in batches])
        assert sorted(order.tolist()) == list(range(20))
        assert torch.equal(torch.cat([b[0] for b in batches]), x[order])
        # The DataLoader itself (what worker processes run) fetches batches too.
        loader.set_epoch(0)
        assert [b[1].tolist() for b in loader.dataloader] == [b[1].tolist() for b in batches]


def test_shuffle_differs_by_epoch_and_repeats_in_a_fresh_loader() -> None:
    loader = build_loader(array_dataset(), batch_size=10, shuffle=True, seed=5)
    epoch0 = ids(loader)
    assert loader.epoch == 1  # a full pass advances the epoch
    epoch1 = ids(loader)
    assert epoch0 != epoch1
    assert sorted(i for batch in epoch0 for i in batch) == list(range(100))
    torch.manual_seed(999)
    fresh = build_loader(array_dataset(), batch_size=10, shuffle=True, seed=5)
    assert ids(fresh) == epoch0
    fresh.set_epoch(1)
    assert ids(fresh) == epoch1
    resumed = build_loader(array_dataset(), batch_size=10, shuffle=True, seed=5)
    resumed.load_state_dict(loader.state_dict())
    assert resumed.epoch == 2 and ids(resumed) == ids(loader)
    other_seed = build_loader(array_dataset(), batch_size=10, shuffle=True, seed=6)
    assert ids(other_seed) != epoch0


def test_weighted_balanced_sampling_evens_out_classes() -> None:
    labels = torch.cat([torch.zeros(95, dtype=torch.long), torch.ones(5, dtype=torch.long)])
    dataset = ArrayDataset(torch.randn(100, 2), labels)
    loader = build_loader(dataset, batch_size=100, weights="balanced", num_samples=4000, seed=0)
    drawn = torch.cat([y for _, y in loader])
    assert drawn.numel() == 4000 and len(loader) == 40
    assert 0.4 < drawn.float().mean().item() < 0.6
    explicit = build_loader(dataset, sampler="weighted", weights=[0.0] * 99 + [1.0], batch_size=7)
    # Under sampler=auto, weights pick the weighted sampler, which also satisfies shuffle.
    auto = build_loader(dataset, shuffle=True, weights=[0.0] * 99 + [1.0], batch_size=50)
    assert torch.cat([y for _, y in auto]).tolist() == [1] * 100
    assert torch.cat([y for _, y in explicit]).tolist() == [1] * 100


def test_balanced_needs_known_labels() -> None:
    with pytest.raises(DataError, match="balanced needs the labels"):
        build_loader(RandomSamples(), weights="balanced")


def test_workers_reproduce_random_augmentation() -> None:
    def run() -> list[torch.Tensor]:
        loader = build_loader(RandomSamples(), batch_size=4, num_workers=2, seed=3)
        return list(loader) + list(loader)  # epochs 0 and 1

    first, second = run(), run()
    assert len(first) == 4
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    assert first[0][:, 0].tolist() == [0, 1, 2, 3]
    for column in (1, 2, 3):  # torch, numpy, random
        assert (first[0][:, column] != first[2][:, column]).all()  # epoch 1 draws anew
        assert (first[0][:, column] != first[1][:, column]).all()  # each worker draws its own
    # Resuming at epoch 1 in a fresh loader reproduces epoch 1.
    resumed = build_loader(RandomSamples(), batch_size=4, num_workers=2, seed=3)
    resumed.set_epoch(1)
    for a, b in zip(list(resumed), first[2:], strict=True):
        assert torch.equal(a, b)


def test_workers_give_the_same_batches_as_the_main_process() -> None:
    main = build_loader(array_dataset(40), batch_size=8, shuffle=True, seed=2)
    workers = build_loader(
        array_dataset(40), batch_size=8, shuffle=True, seed=2, num_workers=2, prefetch_factor=1
    )
    assert ids(workers) == ids(main)


def test_user_collate_fn_receives_samples() -> None:
    seen: list[int] = []

    def collate(samples):
        seen.append(len(samples))
        assert isinstance(samples, list) and isinstance(samples[0], tuple)
        return torch.stack([x for x, _ in samples]).sum()

    loader = build_loader(array_dataset(10), batch_size=4, collate_fn=collate)
    assert [t.item() for t in loader] == [6.0, 22.0, 17.0]
    assert seen == [4, 4, 2] and not loader.returns_batches


def test_plain_map_dataset_uses_default_collate() -> None:
    loader = build_loader(RandomSamples(), batch_size=3, shuffle=True)
    batches = list(loader)
    assert [b.shape for b in batches] == [(3, 4), (3, 4), (2, 4)]
    assert sorted(torch.cat(batches)[:, 0].tolist()) == list(range(8))


def test_iterable_dataset_is_streamed_in_order() -> None:
    loader = build_loader(Stream(), batch_size=4)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    with pytest.raises(TypeError, match="number of batches is unknown"):
        len(loader)
    for options in ({"shuffle": True}, {"sampler": "random"}, {"weights": [1.0] * 10}):
        with pytest.raises(ConfigError) as info:
            build_loader(Stream(), **options)
        assert "IterableDataset" in str(info.value)


@pytest.mark.parametrize(
    ("options", "pattern"),
    [
        ({"batch_size": 0}, r"loader.batch_size must be an int >= 1; got 0"),
        ({"num_workers": -1}, r"loader.num_workers must be an int >= 0; got -1"),
        ({"prefetch_factor": 2}, r"loader.num_workers>0 or drop loader.prefetch_factor"),
        ({"persistent_workers": True}, r"loader.num_workers>0 or set loader.persistent_workers"),
        ({"shuffle": True, "sampler": "sequential"}, r"shuffle=true conflicts.*sequential"),
        ({"sampler": "weighted"}, r"loader.weights=balanced"),
        ({"sampler": "random", "weights": "balanced"}, r"does not use weights"),
        ({"num_samples": 10}, r"only used by the weighted sampler"),
        ({"weights": "uniform"}, r"'uniform' is not understood"),
        ({"sampler": "bucketed"}, r"loader.sampler='bucketed'"),
    ],
)
def test_config_errors_name_the_key(options: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        build_loader(array_dataset(), **options)


def test_config_errors_are_reported_together() -> None:
    with pytest.raises(ConfigError) as info:
        build_loader(array_dataset(), batch_size=0, num_workers=-2)
    assert "loader.batch_size" in str(info.value) and "loader.num_workers" in str(info.value)


def test_dataset_errors() -> None:
    with pytest.raises(DataError, match="0 samples"):
        build_loader(ArrayDataset(torch.zeros(0, 2)))
    with pytest.raises(DataError, match="without __len__"):
        build_loader(Unsized())


def test_pin_memory_without_cuda_warns_and_continues(caplog: pytest.LogCaptureFixture) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the machine without CUDA")
    with caplog.at_level(logging.WARNING, logger="stoker"):
        loader = build_loader(array_dataset(10), batch_size=5, pin_memory=True)
    assert "pin_memory" in caplog.text
    assert loader.dataloader.pin_memory is False and len(list(loader)) == 2
    assert build_loader(array_dataset(10), device="cuda").dataloader.pin_memory is False


def test_set_epoch_reaches_the_sampler() -> None:
    loader = build_loader(array_dataset(), shuffle=True)
    loader.set_epoch(4)
    assert loader.sampler.epoch == 4 and loader.state_dict() == {"epoch": 4}


def test_bucket_sampler_with_pad_collate_gives_masked_batches_of_similar_length() -> None:
    from stoker.data.collate import PadCollate
    from stoker.data.text import TextListDataset
    from stoker.data.tokenizers import ByteTokenizer

    texts = ["x" * (1 + (i * 37) % 90) for i in range(200)]
    dataset = TextListDataset(texts, [i % 3 for i in range(200)], tokenizer=ByteTokenizer())
    loader = build_loader(
        dataset,
        batch_size=8,
        shuffle=True,
        sampler="bucket",
        collate_fn=PadCollate(),
        bucket_size_multiplier=5,
    )
    batches = list(loader)
    assert len(batches) == len(loader) == 25
    seen = 0
    padded = 0
    for inputs, labels in batches:
        mask = inputs["attention_mask"]
        assert inputs["input_ids"].shape == mask.shape and labels.shape == (mask.shape[0],)
        seen += mask.shape[0]
        padded += int((mask == 0).sum())
    assert seen == 200
    total = sum(len(t) for t in texts)
    assert padded / (padded + total) < 0.2  # random batches of 8 would pad ~45%


def test_bucket_sampler_needs_lengths() -> None:
    with pytest.raises(ConfigError, match="lengths"):
        build_loader(ArrayDataset(torch.zeros(10, 2)), sampler="bucket")


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_resumes_mid_epoch_with_exactly_the_remaining_batches(workers: int) -> None:
    dataset = ArrayDataset(torch.arange(100).float().unsqueeze(1), torch.arange(100))
    options = dict(batch_size=8, shuffle=True, seed=7, num_workers=workers)
    original = build_loader(dataset, **options)
    original.set_epoch(3)
    stream = iter(original)
    head = [next(stream) for _ in range(5)]
    state = original.state_dict()
    assert state == {"epoch": 3, "batches_delivered": 5}
    rest = list(stream)

    fresh = build_loader(dataset, **options)
    fresh.load_state_dict(state)
    fresh.set_epoch(3)  # the loop selects the epoch again: the position is kept
    resumed = list(fresh)
    assert len(head) + len(resumed) == 13
    for a, b in zip(rest, resumed, strict=True):
        assert torch.equal(a[1], b[1])
    fresh.set_epoch(4)
    original.set_epoch(4)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(fresh, original, strict=True))
