"""Tests for stoker.data.collate: pad_collate, PadCollate and token_count."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader

from stoker.data.collate import PadCollate, pad_collate, passthrough, token_count
from stoker.errors import ConfigError, DataError


def test_the_exercise_sequences_pad_to_one_batch() -> None:
    batch = pad_collate([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    assert batch["input_ids"].shape == (3, 4)
    assert batch["input_ids"].dtype == torch.long
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert token_count(batch) == 9


def test_left_padding_and_pad_value() -> None:
    batch = pad_collate([torch.tensor([1, 2, 3]), torch.tensor([4])], side="left", pad_value=-1)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [-1, -1, 4]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_truncation_follows_the_padding_side() -> None:
    samples = [[1, 2, 3, 4, 5], [6, 7]]
    right = pad_collate(samples, max_length=3)
    assert right["input_ids"].tolist() == [[1, 2, 3], [6, 7, 0]]  # keeps the start
    left = pad_collate(samples, max_length=3, side="left")
    assert left["input_ids"].tolist() == [[3, 4, 5], [0, 6, 7]]  # keeps the end
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]


def test_pad_to_multiple_of_eight() -> None:
    batch = pad_collate([[1] * 9, [2] * 3], pad_to_multiple_of=8)
    assert batch["input_ids"].shape == (2, 16)
    assert batch["attention_mask"].sum(dim=1).tolist() == [9, 3]
    capped = pad_collate([[1] * 20, [2] * 3], pad_to_multiple_of=8, max_length=16)
    assert capped["input_ids"].shape == (2, 16) and token_count(capped) == 19
    with pytest.raises(ConfigError, match="max_length=12 is not a multiple"):
        pad_collate([[1]], pad_to_multiple_of=8, max_length=12)


def test_tuple_samples_give_inputs_labels_and_extras() -> None:
    samples = [
        (torch.tensor([5, 6, 7]), 1, torch.tensor([0.5, 0.5])),
        (torch.tensor([8]), 0, torch.tensor([1.0, 0.0])),
    ]
    inputs, labels, extra = pad_collate(samples)
    assert inputs["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert labels.tolist() == [1, 0] and labels.dtype == torch.long
    assert extra.tolist() == [[0.5, 0.5], [1.0, 0.0]]
    assert token_count((inputs, labels, extra)) == 4


def test_dict_samples_pad_aligned_fields_and_stack_the_rest() -> None:
    samples = [
        {"input_ids": [1, 2, 3], "labels": [1, 2, 3], "score": 0.5, "span": [0, 1]},
        {"input_ids": [4], "labels": [4], "score": 1.5, "span": [2, 3]},
    ]
    batch = pad_collate(samples, pad_to_multiple_of=4)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [4, 0, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3, -100], [4, -100, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["lengths"].tolist() == [3, 1]
    assert batch["score"].tolist() == [0.5, 1.5]
    assert batch["span"].tolist() == [[0, 1], [2, 3]]


def test_pad_keys_keep_equal_length_fields_aligned() -> None:
    samples = [{"input_ids": [1, 2], "labels": [3, 4]}, {"input_ids": [5, 6], "labels": [7, 8]}]
    batch = pad_collate(samples, pad_to_multiple_of=4)
    assert batch["labels"].shape == batch["input_ids"].shape == (2, 4)
    other = pad_collate(samples, pad_to_multiple_of=4, pad_keys=(), pad_values={"labels": 0})
    assert other["labels"].shape == (2, 2)  # not listed and equal lengths: stacked


def test_dict_with_its_own_mask_and_key() -> None:
    samples = [
        {"tokens": torch.tensor([1, 2]), "attention_mask": torch.tensor([1, 0])},
        {"tokens": torch.tensor([3]), "attention_mask": torch.tensor([1])},
    ]
    batch = pad_collate(samples, sequence_key="tokens")
    assert batch["tokens"].tolist() == [[1, 2], [3, 0]]
    assert batch["attention_mask"].tolist() == [[1, 0], [1, 0]]  # the dataset's mask kept
    with pytest.raises(DataError, match="no 'input_ids' field"):
        pad_collate(samples)


def test_feature_sequences_pad_along_the_first_dimension() -> None:
    batch = pad_collate([torch.ones(3, 2), torch.full((1, 2), 2.0)])
    assert batch["input_ids"].shape == (2, 3, 2) and batch["input_ids"].dtype == torch.float32
    assert batch["input_ids"][1].tolist() == [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]
    with pytest.raises(DataError, match=r"sample 1 has shape \(2, 3\)"):
        pad_collate([torch.ones(3, 2), torch.ones(2, 3)])


def test_pad_collate_class_pickles_and_runs_in_a_loader() -> None:
    collate = PadCollate(max_length=2, side="left")
    assert pickle.loads(pickle.dumps(collate)) == collate
    loader = DataLoader([[1, 2, 3], [4], [5, 6]], batch_size=3, collate_fn=collate)
    (batch,) = list(loader)
    assert batch["input_ids"].tolist() == [[2, 3], [0, 4], [5, 6]]
    assert token_count(batch) == 5


def test_bad_options_and_batches() -> None:
    with pytest.raises(ConfigError, match="side='middle'"):
        PadCollate(side="middle")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pad_to_multiple_of=0"):
        pad_collate([[1]], pad_to_multiple_of=0)
    with pytest.raises(DataError, match="empty batch"):
        pad_collate([])
    with pytest.raises(DataError, match="attention_mask"):
        token_count({"input_ids": torch.ones(2, 2)})


def test_passthrough_is_kept() -> None:
    batch = {"x": torch.ones(2)}
    assert passthrough(batch) is batch
