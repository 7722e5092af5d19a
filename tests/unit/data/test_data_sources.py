"""Tests for stoker.data.sources: ArrayDataset, split_dataset, dataset_targets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from stoker.data import ArrayDataset, dataset_targets, split_dataset
from stoker.data.sources import split_train_val_test
from stoker.errors import ConfigError, DataError


def three_fields() -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    x = torch.arange(20, dtype=torch.float32).reshape(10, 2)
    y = np.arange(10, dtype=np.int64) % 3
    meta = np.arange(100, 110, dtype=np.int32)
    return x, y, meta


class Squares(Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        return i * i


class Stream(IterableDataset):
    def __iter__(self):
        return iter(range(5))


def test_getitem_returns_one_sample_per_field() -> None:
    x, y, meta = three_fields()
    ds = ArrayDataset(x, y, meta, names=["x", "y", "id"])
    assert len(ds) == 10
    sx, sy, sid = ds[3]
    assert torch.equal(sx, torch.tensor([6.0, 7.0]))
    assert sy.item() == 0 and sy.dtype == torch.int64
    assert sid.item() == 103 and sid.dtype == torch.int32
    assert ds[-1][2].item() == 109
    assert ds.names == ("x", "y", "id")
    with pytest.raises(IndexError, match="10 samples"):
        ds[10]


def test_getitems_returns_a_collated_batch() -> None:
    x, y, meta = three_fields()
    ds = ArrayDataset(x, y, meta)
    bx, by, bid = ds.__getitems__([7, 0, 7, 2])
    assert bx.shape == (4, 2) and by.shape == (4,) and bid.shape == (4,)
    assert torch.equal(bx[:, 0], torch.tensor([14.0, 0.0, 14.0, 4.0]))
    assert by.tolist() == [1, 0, 1, 2]
    assert bid.tolist() == [107, 100, 107, 102]
    assert ArrayDataset.returns_batches is True


def test_numpy_is_shared_without_copy() -> None:
    x, y, _ = three_fields()
    ds = ArrayDataset(x, y)
    y[0] = 42
    assert ds.arrays[1][0].item() == 42
    assert ds.targets is ds.arrays[1]
    assert ArrayDataset(x).targets is None


def test_negative_strides_and_readonly_arrays_load() -> None:
    a = np.arange(6, dtype=np.float64)
    a.setflags(write=False)
    ds = ArrayDataset(a[::-1])
    assert ds.arrays[0].tolist() == [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]


def test_length_mismatch_names_every_field() -> None:
    with pytest.raises(DataError) as info:
        ArrayDataset(np.zeros((10, 2)), np.zeros(9), names=["features", "labels"])
    message = str(info.value)
    assert "'features' (position 0) has 10" in message
    assert "'labels' (position 1) has 9" in message
    with pytest.raises(DataError, match="field 0 has 3, field 1 has 4"):
        ArrayDataset(torch.zeros(3), torch.zeros(4))


def test_object_and_string_arrays_are_rejected_by_field() -> None:
    with pytest.raises(DataError, match=r"field 'meta' \(position 1\).*dtype object"):
        ArrayDataset(np.zeros(3), np.array([{}, [], None], dtype=object), names=["x", "meta"])
    with pytest.raises(DataError, match=r"field 0 .*dtype <U1"):
        ArrayDataset(np.array(["a", "b"]))


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(DataError, match="no arrays"):
        ArrayDataset()
    with pytest.raises(DataError, match="list"):
        ArrayDataset([1, 2, 3])
    with pytest.raises(DataError, match="scalar"):
        ArrayDataset(torch.tensor(1.0))
    with pytest.raises(DataError, match="2 names"):
        ArrayDataset(torch.zeros(3), names=["a", "b"])


def test_subset_gathers_rows() -> None:
    x, y, meta = three_fields()
    sub = ArrayDataset(x, y, meta, names=["x", "y", "id"]).subset([9, 1])
    assert isinstance(sub, ArrayDataset)
    assert len(sub) == 2 and sub.names == ("x", "y", "id")
    assert sub.arrays[2].tolist() == [109, 101]


def test_from_tensor_dataset_is_zero_copy() -> None:
    tds = TensorDataset(torch.zeros(4, 2), torch.arange(4))
    ds = ArrayDataset.from_tensor_dataset(tds)
    assert ds.arrays[0].data_ptr() == tds.tensors[0].data_ptr()
    assert ds.targets.tolist() == [0, 1, 2, 3]


def test_split_is_deterministic_disjoint_and_sized() -> None:
    ds = ArrayDataset(torch.arange(100), torch.arange(100) % 2)
    train, val = split_dataset(ds, 0.2, seed=7)
    again_train, again_val = split_dataset(ds, 0.2, seed=7)
    other_train, _ = split_dataset(ds, 0.2, seed=8)
    assert isinstance(train, ArrayDataset) and isinstance(val, ArrayDataset)
    assert len(train) == 80 and len(val) == 20
    train_ids, val_ids = train.arrays[0].tolist(), val.arrays[0].tolist()
    assert set(train_ids).isdisjoint(val_ids)
    assert sorted(train_ids + val_ids) == list(range(100))
    assert train_ids == sorted(train_ids)
    assert train_ids == again_train.arrays[0].tolist()
    assert val_ids == again_val.arrays[0].tolist()
    assert train_ids != other_train.arrays[0].tolist()


def test_split_other_datasets() -> None:
    train, val = split_dataset(TensorDataset(torch.arange(10)), 0.3, seed=0)
    assert isinstance(train, ArrayDataset) and (len(train), len(val)) == (7, 3)
    train, val = split_dataset(Squares(), 0.01, seed=0)
    assert isinstance(val, Subset) and len(val) == 1 and len(train) == 9
    assert {train[i] for i in range(9)} | {val[0]} == {i * i for i in range(10)}


def test_split_errors() -> None:
    ds = ArrayDataset(torch.arange(10))
    for bad in (0.0, 1.0, -0.1, 1.5, "0.1", True):
        with pytest.raises(ConfigError, match="strictly between 0 and 1"):
            split_dataset(ds, bad, seed=0)
    with pytest.raises(DataError) as info:
        split_dataset(Stream(), 0.1, seed=0)
    assert "separate validation set" in str(info.value.hint)
    with pytest.raises(DataError, match="1 sample"):
        split_dataset(ArrayDataset(torch.arange(1)), 0.5, seed=0)


def test_dataset_targets() -> None:
    labels = torch.tensor([3, 1, 2, 0])
    assert torch.equal(dataset_targets(ArrayDataset(torch.zeros(4), labels)), labels)
    assert torch.equal(dataset_targets(TensorDataset(torch.zeros(4), labels)), labels)
    assert dataset_targets(Subset(TensorDataset(torch.zeros(4), labels), [3, 0])).tolist() == [0, 3]
    with_attr = Squares()
    with_attr.targets = [1, 1, 0]  # type: ignore[attr-defined]
    assert dataset_targets(with_attr).tolist() == [1, 1, 0]
    assert dataset_targets(Squares()) is None
    assert dataset_targets(TensorDataset(torch.zeros(4))) is None


def test_a_test_share_leaves_the_validation_split_as_it_was() -> None:
    ds = ArrayDataset(torch.arange(100))
    _, val_alone = split_dataset(ds, 0.2, seed=3)
    train, val, test = split_train_val_test(ds, val_fraction=0.2, test_fraction=0.1, seed=3)
    assert val is not None and test is not None
    ids = [part.arrays[0].tolist() for part in (train, val, test)]  # type: ignore[attr-defined]
    assert [len(part) for part in ids] == [70, 20, 10]
    assert ids[1] == val_alone.arrays[0].tolist()
    assert sorted(ids[0] + ids[1] + ids[2]) == list(range(100))
    train, val, test = split_train_val_test(ds, val_fraction=None, test_fraction=0.25, seed=3)
    assert val is None and len(test) == 25 and len(train) == 75  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="test_fraction must be strictly between 0 and 1"):
        split_train_val_test(ds, val_fraction=None, test_fraction=1.0, seed=0)
    with pytest.raises(DataError, match="into 3 parts"):
        split_train_val_test(
            ArrayDataset(torch.arange(2)), val_fraction=0.5, test_fraction=0.5, seed=0
        )
