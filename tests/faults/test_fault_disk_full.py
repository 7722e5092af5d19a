"""Fault injection: a full disk (ENOSPC) at every point of a save changes nothing on disk."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.checkpoint import Checkpointer, find_latest_valid, load_checkpoint
from stoker.errors import CheckpointError


def no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` with its bytes (None for folders)."""
    return {
        str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
        for path in sorted(directory.rglob("*"))
    }


def fail_on_call(n: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that its ``n``-th call (from 1) raises ENOSPC."""
    calls = 0

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == n:
            raise no_space()
        return real(*args, **kwargs)

    return wrapper


@pytest.fixture
def checkpointer(tmp_path: Path) -> Any:
    """keep_last=2 after four saves: steps 3 and 4, the best step 1, both pointers."""
    ckpt = Checkpointer(tmp_path, keep_last=2)
    for step, loss in [(1, 0.1), (2, 0.5), (3, 0.6), (4, 0.7)]:
        ckpt.save(
            {"step": step, "w": torch.full((256,), float(step))},
            epoch=step,
            step=step,
            metrics={"val/loss": loss},
        )
    yield ckpt
    ckpt.close()


def new_best(ckpt: Checkpointer) -> Path:
    # A new best: the save writes the folder, last.json and best.json, and then rotates.
    return ckpt.save(
        {"step": 5, "w": torch.full((256,), 5.0)}, epoch=5, step=5, metrics={"val/loss": 0.01}
    )


def assert_nothing_changed(
    directory: Path, before: dict[str, bytes | None], ckpt: Checkpointer
) -> None:
    assert snapshot(directory) == before
    assert ckpt.best_value == 0.1
    assert ckpt.state_dict()["best_checkpoint"] == "step-00000001"
    assert find_latest_valid(directory) == (directory / "step-00000004", [])


@pytest.mark.parametrize("target", ["fsync", "replace", "rename"])
def test_enospc_at_every_call_of_a_save_leaves_everything_as_it_was(
    tmp_path: Path, checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch, target: str
) -> None:
    """Fails the n-th ``os.<target>`` call of a save, for n = 1, 2, ... until one succeeds."""
    before = snapshot(tmp_path)
    real = getattr(os, target)
    failures = 0
    for n in range(1, 50):
        monkeypatch.setattr(os, target, fail_on_call(n, real))
        try:
            saved = new_best(checkpointer)
        except CheckpointError as exc:
            monkeypatch.setattr(os, target, real)
            failures += 1
            assert "No space left on device (ENOSPC)" in exc.message, exc
            assert str(tmp_path / "step-00000005") in exc.message
            assert exc.hint is not None and "keep_last" in exc.hint
            assert_nothing_changed(tmp_path, before, checkpointer)
            continue
        monkeypatch.setattr(os, target, real)
        break
    else:
        pytest.fail("the save never succeeded")

    # Every fsync point (state, manifest, folder, marker, both pointers, the folder of the
    # checkpoints), every pointer replace and the folder rename were hit once.
    assert failures >= {"fsync": 8, "replace": 2, "rename": 1}[target]
    assert saved == tmp_path / "step-00000005"
    assert find_latest_valid(tmp_path) == (saved, [])
    assert checkpointer.last_path == checkpointer.best_path == saved
    assert load_checkpoint(tmp_path / "best.json")["step"] == 5
    kept = ["step-00000004", "step-00000005"]
    if target == "rename":
        # The call after the commit's rename is rotation's: it failed, with a warning only.
        kept.insert(0, "step-00000003")
    assert sorted(p.name for p in tmp_path.glob("step-*")) == kept


def test_enospc_while_torch_writes_the_state(
    tmp_path: Path, checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = snapshot(tmp_path)

    def write_half_then_fail(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        f.write(b"\0" * 4096)
        raise no_space()

    monkeypatch.setattr(torch, "save", write_half_then_fail)
    with pytest.raises(CheckpointError, match="No space left on device"):
        new_best(checkpointer)
    monkeypatch.undo()

    assert_nothing_changed(tmp_path, before, checkpointer)


def test_enospc_creating_the_folder(
    tmp_path: Path, checkpointer: Checkpointer, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = snapshot(tmp_path)
    monkeypatch.setattr(os, "mkdir", fail_on_call(1, os.mkdir))

    with pytest.raises(CheckpointError, match="No space left on device"):
        new_best(checkpointer)
    monkeypatch.undo()

    assert_nothing_changed(tmp_path, before, checkpointer)


def test_a_state_that_cannot_be_pickled_changes_nothing(
    tmp_path: Path, checkpointer: Checkpointer
) -> None:
    before = snapshot(tmp_path)

    with pytest.raises(CheckpointError, match="Could not write checkpoint") as info:
        checkpointer.save({"fn": lambda x: x}, epoch=5, step=5, metrics={"val/loss": 0.01})

    assert info.value.hint is not None and "plain data" in info.value.hint
    assert_nothing_changed(tmp_path, before, checkpointer)


def test_a_failed_rotation_is_a_warning_not_a_failed_save(
    tmp_path: Path,
    checkpointer: Checkpointer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EACCES, os.strerror(errno.EACCES))

    # The first os.rename is the commit of the new folder; the next ones are rotation's.
    monkeypatch.setattr(os, "rename", fail_on_call(2, os.rename))
    monkeypatch.setattr("shutil.rmtree", refuse)
    saved = new_best(checkpointer)
    monkeypatch.undo()

    assert find_latest_valid(tmp_path) == (saved, [])
    assert "could not delete old checkpoint" in caplog.text
