"""data.cache=memory on a per-sample Dataset: read once into arrays, same batches."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset

import stoker
from stoker.data.cache_arrays import materialize
from stoker.data.sources import ArrayDataset


class RowDataset(Dataset):
    """The seed module's shape of Dataset: one numpy row and a numpy label per call."""

    def __init__(self, n: int = 96) -> None:
        rng = np.random.default_rng(1)
        self.X = rng.normal(size=(n, 5)).astype("float32")
        self.y = (self.X[:, 0] > 0).astype("int64")
        self.reads = 0

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, index: int):
        self.reads += 1
        return torch.from_numpy(self.X[index]), self.y[index]


class Jitter(RowDataset):
    def __getitem__(self, index: int):
        x, y = super().__getitem__(index)
        return x + torch.randn(5) * 0.1, y  # random augmentation: not cacheable as arrays


def test_a_deterministic_dataset_becomes_arrays_with_collate_dtypes() -> None:
    data = RowDataset()
    arrays = materialize(data)
    assert isinstance(arrays, ArrayDataset)
    x, y = arrays.__getitems__([3, 0, 7])
    collated = torch.utils.data.default_collate([data[3], data[0], data[7]])
    assert torch.equal(x, collated[0]) and torch.equal(y, collated[1])
    assert y.dtype == collated[1].dtype == torch.int64


def test_random_samples_or_ragged_fields_are_not_materialized() -> None:
    assert materialize(Jitter()) is None

    class Ragged(RowDataset):
        def __getitem__(self, index: int):
            return torch.zeros(1 + index % 2), 0

    assert materialize(Ragged()) is None
    assert materialize([("text", 1)]) is None  # a field that is no number or array


def test_fit_with_cache_memory_trains_the_same_weights_from_arrays(tmp_path) -> None:
    def run(cache: str, data: Dataset):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 2)
        stoker.fit(
            model,
            data,
            epochs=2,
            batch_size=16,
            cache=cache,
            threads=1,
            progress="quiet",
            tensorboard=False,
            run_dir=tmp_path / cache,
        )
        return model

    cached_data = RowDataset()
    plain, cached = run("none", RowDataset()), run("memory", cached_data)
    for p, q in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(p, q)
    # Each sample read once (plus the determinism probes), not once per epoch.
    assert cached_data.reads < 96 + 16
