"""Tests for atomic single-file writes and safe (weights_only) single-file loads."""

from __future__ import annotations

import dataclasses
import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from stoker.checkpoint import load_state_file, save_atomic
from stoker.errors import CheckpointError


@dataclasses.dataclass
class RunInfo:
    name: str
    seed: int


class CreatesFileOnUnpickle:
    """Unpickling this calls open(target, "w"): a stand-in for arbitrary code in a pickle."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.target), "w"))


def assert_same(expected: Any, actual: Any) -> None:
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(expected[key], actual[key])
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            assert_same(e, a)
    else:
        assert actual == expected


def trained_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    generator = torch.Generator().manual_seed(7)
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 3,
        "lr": 1e-3,
        "name": "run-a",
        "history": [0.5, 0.25, None, True],
        "shape": (2, 3),
        "nested": {"counts": [1, 2, 3], "pair": ("a", 1.5)},
        "rng": {"torch": torch.get_rng_state(), "generator": generator.get_state()},
    }


def test_round_trip_keeps_model_optimizer_plain_data_and_rng(tmp_path: Path) -> None:
    state = trained_state()
    path = save_atomic(state, tmp_path / "ckpt.pt")

    loaded = load_state_file(path)

    assert path == tmp_path / "ckpt.pt"
    assert_same(state, loaded)
    # The restored RNG state must reproduce the same random stream.
    torch.set_rng_state(loaded["rng"]["torch"])
    first = torch.rand(4)
    torch.set_rng_state(state["rng"]["torch"])
    assert torch.equal(first, torch.rand(4))


def test_save_atomic_replaces_an_existing_file_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    save_atomic({"version": 1}, path)
    save_atomic({"version": 2}, str(path))

    assert load_state_file(path) == {"version": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


@pytest.mark.skipif(os.name != "posix", reason="file modes are POSIX")
def test_saved_file_gets_the_umask_mode_not_mkstemp_0600(tmp_path: Path) -> None:
    path = save_atomic({"a": 1}, tmp_path / "ckpt.pt")

    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    target = tmp_path / "created-by-unpickling.txt"
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": CreatesFileOnUnpickle(target)}, path)

    with pytest.raises(CheckpointError) as info:
        load_state_file(path)

    assert not target.exists()
    message = str(info.value)
    assert str(path) in message
    assert "arbitrary Python objects" in message
    assert "refuses to unpickle" in message
    assert "open" in info.value.message
    assert info.value.hint is not None and "re-save the checkpoint" in info.value.hint
    # The payload is live: an unsafe load would have created the file.
    torch.load(path, weights_only=False)
    assert target.exists()


def test_checkpoint_with_a_dataclass_is_refused_naming_the_class(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save({"info": RunInfo("a", 1)}, path)

    with pytest.raises(CheckpointError, match="arbitrary Python objects") as info:
        load_state_file(path)

    assert "RunInfo" in info.value.message
    assert str(path) in info.value.message


@pytest.mark.parametrize("keep", [0.0, 0.01, 0.5, 0.99])
def test_truncated_checkpoint_is_reported_with_its_path(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "ckpt.pt"
    save_atomic({"w": torch.arange(1000.0), "step": 5}, path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])

    with pytest.raises(CheckpointError, match="truncated or not a checkpoint") as info:
        load_state_file(path)

    assert str(path) in info.value.message


def test_garbage_file_is_reported_as_not_a_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "notes.pt"
    path.write_bytes(b"hello world, not a checkpoint " * 20)

    with pytest.raises(CheckpointError, match="truncated or not a checkpoint"):
        load_state_file(path)


def test_missing_checkpoint_names_the_path_and_lists_the_folder(tmp_path: Path) -> None:
    save_atomic({"a": 1}, tmp_path / "epoch-0001-step-00000010.pt")
    missing = tmp_path / "epoch-0002-step-00000020.pt"

    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_state_file(missing)

    assert str(missing) in info.value.message
    assert info.value.hint is not None
    assert "epoch-0001-step-00000010.pt" in info.value.hint


def test_missing_checkpoint_in_a_missing_folder_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        load_state_file(tmp_path / "nope" / "last.pt")

    assert info.value.hint is not None and "does not exist either" in info.value.hint


def test_a_folder_is_not_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is a folder"):
        load_state_file(tmp_path)


def test_a_checkpoint_that_is_not_a_dict_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "list.pt"
    torch.save([1, 2, 3], path)

    with pytest.raises(CheckpointError, match="holds a list, not a dict"):
        load_state_file(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_map_location_to_a_missing_device_is_explained(tmp_path: Path) -> None:
    path = save_atomic({"w": torch.ones(2)}, tmp_path / "ckpt.pt")

    with pytest.raises(CheckpointError, match="map_location") as info:
        load_state_file(path, map_location="cuda")

    assert info.value.hint is not None and 'map_location="cpu"' in info.value.hint


def _write_half_then_fail(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    Path(f).write_bytes(b"partial")
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_failed_save_keeps_the_old_file_and_removes_the_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pt"
    save_atomic({"version": 1}, path)
    monkeypatch.setattr(torch, "save", _write_half_then_fail)

    with pytest.raises(CheckpointError) as info:
        save_atomic({"version": 2}, path)

    monkeypatch.undo()
    assert str(path) in info.value.message
    assert "No space left on device" in info.value.message
    assert "ENOSPC" in info.value.message
    assert info.value.hint is not None and "keep_last" in info.value.hint
    assert load_state_file(path) == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_failed_rename_keeps_the_old_file_and_removes_the_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt.pt"
    save_atomic({"version": 1}, path)

    def no_space(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", no_space)
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_atomic({"version": 2}, path)

    monkeypatch.undo()
    assert load_state_file(path) == {"version": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_state_that_cannot_be_pickled_is_an_error_with_no_temp_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="Could not write checkpoint") as info:
        save_atomic({"fn": lambda x: x}, tmp_path / "ckpt.pt")

    assert info.value.hint is not None and "plain data" in info.value.hint
    assert list(tmp_path.iterdir()) == []


def test_saving_into_a_missing_folder_says_to_create_it(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "ckpt.pt"

    with pytest.raises(CheckpointError) as info:
        save_atomic({"a": 1}, path)

    assert str(path) in info.value.message
    assert info.value.hint is not None and "create the folder" in info.value.hint
