"""Tests for exporting model weights to .safetensors and loading them back."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch import nn

from stoker.checkpoint import export_safetensors, load_safetensors_into
from stoker.errors import CheckpointError


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


class CompiledStandIn(nn.Module):
    """Like torch.compile's OptimizedModule: the real model is ``_orig_mod``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 2))
    model.train()
    model(torch.randn(8, 3))  # fills the BatchNorm running stats
    return model


def file_keys(path: Path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def assert_same_weights(expected: nn.Module, actual: nn.Module) -> None:
    want, got = expected.state_dict(), actual.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_round_trip_into_a_fresh_model(tmp_path: Path) -> None:
    source, fresh = mlp(0), mlp(1)
    assert not torch.equal(source[0].weight, fresh[0].weight)

    path = export_safetensors(source, tmp_path / "model.safetensors")
    result = load_safetensors_into(fresh, path)

    assert result == ([], [])
    assert_same_weights(source, fresh)
    assert file_keys(path) == set(source.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = TiedLM()
    torch.manual_seed(1)
    fresh = TiedLM()

    path = export_safetensors(source, tmp_path / "lm.safetensors")
    load_safetensors_into(fresh, path)

    assert len(file_keys(path) & {"embed.weight", "head.weight"}) == 1
    assert_same_weights(source, fresh)
    assert fresh.head.weight is fresh.embed.weight


def test_compile_wrapper_is_stripped(tmp_path: Path) -> None:
    source, fresh = mlp(0), mlp(1)

    path = export_safetensors(CompiledStandIn(source), tmp_path / "model.safetensors")

    assert file_keys(path) == set(source.state_dict())
    load_safetensors_into(fresh, path)
    assert_same_weights(source, fresh)


def test_data_parallel_and_nested_wrappers_are_stripped(tmp_path: Path) -> None:
    source, fresh = mlp(0), mlp(1)
    wrapped = CompiledStandIn(nn.DataParallel(source))

    path = export_safetensors(wrapped, tmp_path / "model.safetensors")

    assert file_keys(path) == set(source.state_dict())
    # Loading into a wrapped model fills the inner one.
    load_safetensors_into(CompiledStandIn(fresh), path)
    assert_same_weights(source, fresh)


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated"])
def test_broken_file_is_an_error_naming_the_path(tmp_path: Path, damage: str) -> None:
    path = export_safetensors(mlp(0), tmp_path / "model.safetensors")
    data = path.read_bytes()
    broken = {"garbage": b"not safetensors " * 10, "empty": b"", "truncated": data[:-8]}[damage]
    path.write_bytes(broken)

    with pytest.raises(CheckpointError, match="is broken") as info:
        load_safetensors_into(mlp(1), path)

    assert str(path) in info.value.message


def test_missing_file_is_an_error_listing_the_folder(tmp_path: Path) -> None:
    export_safetensors(mlp(0), tmp_path / "other.safetensors")
    missing = tmp_path / "model.safetensors"

    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_safetensors_into(mlp(1), missing)

    assert str(missing) in info.value.message
    assert info.value.hint is not None and "other.safetensors" in info.value.hint


def test_a_different_architecture_is_an_error(tmp_path: Path) -> None:
    path = export_safetensors(nn.Linear(3, 2), tmp_path / "linear.safetensors")

    with pytest.raises(CheckpointError, match="does not fit Linear") as info:
        load_safetensors_into(nn.Linear(3, 4), path)

    assert "size mismatch" in info.value.message


def test_non_strict_load_reports_missing_and_unexpected_keys(tmp_path: Path) -> None:
    path = export_safetensors(nn.Sequential(nn.Linear(3, 2)), tmp_path / "a.safetensors")
    target = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))

    with pytest.raises(CheckpointError, match="Missing key"):
        load_safetensors_into(target, path)
    missing, unexpected = load_safetensors_into(target, path, strict=False)

    assert missing == ["1.bias", "1.weight"]
    assert unexpected == []


def test_failed_export_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = export_safetensors(mlp(0), tmp_path / "model.safetensors")
    before = path.read_bytes()

    def no_space(model: Any, filename: str, **kwargs: Any) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors.torch, "save_model", no_space)
    with pytest.raises(CheckpointError, match="No space left on device") as info:
        export_safetensors(mlp(1), path)

    assert str(path) in info.value.message
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
@pytest.mark.parametrize("whole_state", [False, True])
def test_export_gets_the_umask_mode_not_safetensors_0600(tmp_path: Path, whole_state: bool) -> None:
    model = mlp(0)
    state = model.state_dict() if whole_state else None
    path = export_safetensors(model, tmp_path / "model.safetensors", state=state)

    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
