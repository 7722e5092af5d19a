"""Tests for stoker.data.device: resolving devices and moving nested batches."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

from stoker.data import ArrayDataset, build_loader, move_to_device, resolve_device
from stoker.errors import ConfigError

Pair = namedtuple("Pair", ["x", "y"])


def test_cpu_move_keeps_the_same_objects() -> None:
    x, y = torch.ones(2), torch.zeros(3)
    batch = {"pair": Pair(x, y), "list": [x, "label", 3], "plain": (y,)}
    moved = move_to_device(batch, "cpu")
    assert moved is batch
    assert move_to_device(x, torch.device("cpu")) is x


def test_move_rebuilds_structure_with_its_types() -> None:
    x = torch.ones(2, dtype=torch.float64)
    meta = torch.device("meta")  # a second device every machine has
    batch = OrderedDict(pair=Pair(x, 7), items=[x, "s"], nested=({"t": x},))
    moved = move_to_device(batch, meta)
    assert type(moved) is OrderedDict and list(moved) == ["pair", "items", "nested"]
    assert type(moved["pair"]) is Pair and moved["pair"].y == 7
    assert moved["pair"].x.device.type == "meta" and moved["pair"].x.shape == (2,)
    assert moved["items"][1] == "s" and moved["items"][0].device.type == "meta"
    assert moved["nested"][0]["t"].device.type == "meta"
    assert batch["pair"].x.device.type == "cpu"  # the input is left alone


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device().type in {"cuda", "mps", "cpu"}
    with pytest.raises(ConfigError, match="not a device"):
        resolve_device("tpu9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_resolve_cuda_without_cuda_names_the_fix() -> None:
    assert resolve_device("auto") != torch.device("cuda")
    with pytest.raises(ConfigError) as info:
        resolve_device("cuda")
    assert "CUDA is not available" in str(info.value)
    assert info.value.hint == "set train.device=auto or train.device=cpu"


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")


@pytest.mark.cuda
@needs_cuda
def test_pinned_batches_move_to_cuda_and_back() -> None:
    loader = build_loader(
        ArrayDataset(torch.randn(10, 3), torch.arange(10)), batch_size=4, device="cuda"
    )
    assert loader.dataloader.pin_memory is True
    x, y = next(iter(loader))
    assert x.is_pinned() and y.is_pinned()
    moved = move_to_device({"x": x, "pair": Pair(x, y)}, resolve_device("cuda"))
    assert moved["x"].device.type == "cuda" and type(moved["pair"]) is Pair
    back = move_to_device(moved, "cpu")  # blocking: the host reads it at once
    assert torch.equal(back["pair"].y, y)
