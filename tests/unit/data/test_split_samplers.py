"""Samplers that need lengths or labels, on the training part of a ``val_fraction`` split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Subset

import stoker
from stoker.data import ArrayDataset, build_loader, split_dataset
from stoker.data.bucketing import LengthBucketBatchSampler
from stoker.data.cache import CachedDataset
from stoker.data.text import JsonlDataset, TextListDataset
from stoker.data.tokenizers import ByteTokenizer
from stoker.errors import ConfigError, DataError

QUIET = dict(progress="quiet", tensorboard=False)


def texts(n: int = 120) -> TextListDataset:
    """Texts of lengths 1..40 whose class is their length's parity: lengths vary a lot."""
    words = ["x" * (1 + i % 40) for i in range(n)]
    return TextListDataset(words, [(1 + i % 40) % 2 for i in range(n)], tokenizer=ByteTokenizer())


class MeanOfTokens(torch.nn.Module):
    """Embeddings averaged over the real tokens of a padded batch."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(257, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.head(pooled)


class Labelled(Dataset):
    """A user's dataset with a ``targets`` attribute (class 1 is rare) and no lengths."""

    def __init__(self, n: int = 100) -> None:
        self.x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
        self.targets = torch.tensor([1 if i % 10 == 0 else 0 for i in range(n)])

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        return self.x[i], self.targets[i]


class Plain(Labelled):
    """The same samples without labels known up front."""

    def __init__(self, n: int = 100) -> None:
        super().__init__(n)
        self.labels = self.targets
        del self.targets

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.x[i], self.labels[i]


def test_bucket_lengths_come_through_the_split() -> None:
    whole = texts()
    train, _ = split_dataset(whole, 0.2, seed=0)
    assert isinstance(train, Subset)
    loader = build_loader(train, batch_size=8, sampler="bucket", shuffle=True, collate_fn=len)
    sampler = loader.sampler
    assert isinstance(sampler, LengthBucketBatchSampler)
    expected = whole.lengths()[torch.as_tensor(train.indices)]
    assert torch.equal(sampler.lengths, expected)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(len(train)))
    # Batches of similar lengths: far less padding than random batches of the same size.
    stats = sampler.padding_stats()
    assert stats["padding_fraction"] < 0.5 * stats["random_padding_fraction"]


def test_bucket_lengths_come_through_a_cache() -> None:
    train, _ = split_dataset(texts(), 0.25, seed=1)
    cached = CachedDataset(train, mode="memory")
    loader = build_loader(cached, batch_size=8, sampler="bucket", collate_fn=len)
    assert torch.equal(loader.sampler.lengths, train.dataset.lengths()[train.indices])


def test_balanced_weights_come_through_a_split_and_a_cache() -> None:
    train, _ = split_dataset(Labelled(), 0.2, seed=0)
    loader = build_loader(CachedDataset(train, mode="memory"), batch_size=10, weights="balanced")
    labels = Labelled().targets[torch.as_tensor(train.indices)]
    weights = loader.sampler.weights
    assert weights.numel() == len(train) == 80
    # Each class carries half the weight: the rare class is drawn as often as the common one.
    assert weights[labels == 1].sum().item() == pytest.approx(weights[labels == 0].sum().item())


@pytest.mark.parametrize("make", [Labelled, lambda: ArrayDataset(torch.randn(100, 4))])
def test_weights_for_the_whole_data_are_taken_for_the_training_part(make) -> None:
    whole = make()
    given = torch.arange(100, dtype=torch.float64) + 1.0
    train, _ = split_dataset(whole, 0.3, seed=2)
    loader = build_loader(train, batch_size=10, weights=given.tolist())
    picked = torch.as_tensor(train.indices if isinstance(train, Subset) else train._origin[1])
    assert torch.equal(loader.sampler.weights, given[picked])
    # One weight per sample of the part itself is used as it is.
    own = build_loader(train, batch_size=10, weights=[1.0] * len(train))
    assert torch.equal(own.sampler.weights, torch.ones(70, dtype=torch.float64))


def test_weights_that_fit_neither_name_both_lengths() -> None:
    train, _ = split_dataset(Labelled(), 0.3, seed=2)
    with pytest.raises(DataError, match=r"has 50 entries.*70 samples \(split from 100") as caught:
        build_loader(train, batch_size=10, weights=[1.0] * 50)
    assert (
        caught.value.hint
        == "give 100 (one per sample of data.train) or 70 weights, in the order of the samples"
    )


def test_fit_buckets_and_balances_with_val_fraction(tmp_path: Path) -> None:
    bucketed = stoker.fit(
        MeanOfTokens(),
        texts(),
        val_fraction=0.2,
        sampler="bucket",
        collate_fn="pad",
        epochs=2,
        batch_size=16,
        run_dir=tmp_path / "bucket",
        **QUIET,
    )
    assert [r["epoch"] for r in bucketed.history] == [1, 2]
    assert all("val/accuracy" in r for r in bucketed.history)
    balanced = stoker.fit(
        torch.nn.Linear(4, 2),
        Labelled(),
        val_fraction=0.2,
        weights="balanced",
        cache="memory",
        epochs=1,
        batch_size=16,
        run_dir=tmp_path / "balanced",
        **QUIET,
    )
    assert "val/loss" in balanced.metrics


def test_bucket_without_lengths_names_the_fix_that_applies() -> None:
    train, _ = split_dataset(Labelled(), 0.2, seed=0)
    with pytest.raises(ConfigError, match="Subset of Labelled has no lengths") as user:
        build_loader(train, batch_size=8, sampler="bucket")
    assert "add a lengths() method to Labelled" in user.value.hint
    with pytest.raises(ConfigError, match="ArrayDataset has no lengths") as own:
        build_loader(ArrayDataset(torch.zeros(10, 2)), batch_size=8, sampler="bucket")
    assert "set loader.sampler=random" in own.value.hint
    for hint in (user.value.hint, own.value.hint):
        assert "collate" not in hint and "JsonlDataset" not in hint


def test_lengths_of_the_wrong_count_are_named() -> None:
    class Short(Labelled):
        def lengths(self) -> list[int]:
            return [3] * 7

    with pytest.raises(DataError, match=r"Short.lengths\(\) gave 7 lengths for its 100 samples"):
        build_loader(split_dataset(Short(), 0.2, seed=0)[0], batch_size=8, sampler="bucket")


def test_balanced_without_labels_names_the_fix_that_applies(tmp_path: Path) -> None:
    train, _ = split_dataset(Plain(), 0.2, seed=0)
    with pytest.raises(DataError, match="labels of Subset of Plain") as user:
        build_loader(train, batch_size=8, weights="balanced")
    assert "give Plain a `targets` attribute" in user.value.hint
    with pytest.raises(ConfigError) as unset:
        build_loader(train, batch_size=8, sampler="weighted")
    assert "weights=balanced cannot" not in unset.value.hint
    assert "give Plain a `targets` attribute" in unset.value.hint
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"text": "a", "label": i % 2}) + "\n" for i in range(6)))
    with pytest.raises(DataError) as own:
        build_loader(JsonlDataset(path), batch_size=2, weights="balanced")
    assert "set loader.weights to one weight per sample" in own.value.hint
    assert "targets" not in own.value.hint


def test_bucket_on_a_stream_is_an_error_not_ignored() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ConfigError, match="bucket cannot group Stream"):
        build_loader(Stream(), batch_size=2, sampler="bucket")
