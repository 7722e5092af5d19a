"""Tests for the Checkpointer: rotation, last.pt/best.pt, resume of the best, find_latest."""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.checkpoint import Checkpointer, find_latest, load_checkpoint
from stoker.checkpoint.store import STATE_KEY
from stoker.errors import CheckpointError


def state_for(epoch: int) -> dict[str, Any]:
    return {"epoch": epoch, "w": torch.full((3,), float(epoch))}


def epoch_name(epoch: int, step: int) -> str:
    return f"epoch-{epoch:04d}-step-{step:08d}.pt"


def saved_epoch(path: Path) -> int:
    state = load_checkpoint(path)
    assert torch.equal(state["w"], torch.full((3,), float(state["epoch"])))
    return state["epoch"]


@pytest.mark.parametrize(
    ("mode", "values", "best_epoch"),
    [
        ("min", [0.5, 0.3, 0.4, 0.35, 0.6], 2),
        ("max", [0.1, 0.4, 0.9, 0.2, 0.3], 3),
    ],
)
def test_keep_last_two_after_five_saves(
    tmp_path: Path, mode: Any, values: list[float], best_epoch: int
) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=2, monitor="val/metric", mode=mode)
    written = []
    for epoch, value in enumerate(values, start=1):
        written.append(
            ckpt.save(
                state_for(epoch), epoch=epoch, step=epoch * 100, metrics={"val/metric": value}
            )
        )

    assert written[-1] == tmp_path / epoch_name(5, 500)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [epoch_name(4, 400), epoch_name(5, 500), "best.pt", "last.pt"]
    )
    assert ckpt.last_path == tmp_path / "last.pt"
    assert ckpt.best_path == tmp_path / "best.pt"
    assert saved_epoch(tmp_path / "last.pt") == 5
    # The best epoch file was rotated away; best.pt still holds its content.
    assert saved_epoch(tmp_path / "best.pt") == best_epoch
    assert ckpt.best_value == values[best_epoch - 1]


def test_last_and_best_are_hard_links_to_the_epoch_file(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    path = ckpt.save(state_for(1), epoch=1, step=10, metrics={"val/loss": 1.0})

    assert os.path.samefile(path, tmp_path / "last.pt")
    assert os.path.samefile(path, tmp_path / "best.pt")


def test_without_hard_links_last_and_best_are_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(src: Any, dst: Any) -> None:
        raise OSError(errno.EPERM, "hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    ckpt = Checkpointer(tmp_path, keep_last=1)
    for epoch, loss in [(1, 0.5), (2, 0.7), (3, 0.9)]:
        ckpt.save(state_for(epoch), epoch=epoch, step=epoch, metrics={"val/loss": loss})

    assert not os.path.samefile(tmp_path / epoch_name(3, 3), tmp_path / "last.pt")
    assert saved_epoch(tmp_path / "last.pt") == 3
    assert saved_epoch(tmp_path / "best.pt") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", epoch_name(3, 3), "last.pt"]


def test_nan_is_never_the_best(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": math.nan})
    assert ckpt.best_path is None
    assert ckpt.best_value is None

    ckpt.save(state_for(2), epoch=2, step=2, metrics={"val/loss": 2.0})
    ckpt.save(state_for(3), epoch=3, step=3, metrics={"val/loss": math.nan})

    assert ckpt.best_value == 2.0
    assert saved_epoch(tmp_path / "best.pt") == 2
    assert saved_epoch(tmp_path / "last.pt") == 3


def test_best_survives_state_dict_into_a_fresh_checkpointer(tmp_path: Path) -> None:
    first = Checkpointer(tmp_path)
    for epoch, loss in [(1, 0.1), (2, 0.3), (3, 0.5)]:
        first.save(state_for(epoch), epoch=epoch, step=epoch, metrics={"val/loss": loss})

    resumed = Checkpointer(tmp_path)
    resumed.load_state_dict(first.state_dict())
    assert resumed.best_value == 0.1
    resumed.save(state_for(4), epoch=4, step=4, metrics={"val/loss": 0.2})

    assert saved_epoch(tmp_path / "best.pt") == 1
    assert resumed.best_value == 0.1
    assert resumed.state_dict() == {
        "monitor": "val/loss",
        "mode": "min",
        "best_value": 0.1,
        "best_epoch": 1,
        "best_step": 1,
    }


def test_each_checkpoint_holds_the_state_after_its_own_save(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    ckpt.save(state_for(1), epoch=1, step=10, metrics={"val/loss": 0.5})
    # The caller's copy of the state is from before this save, when epoch 1 was the best.
    ckpt.save(
        {**state_for(2), STATE_KEY: ckpt.state_dict()},
        epoch=2,
        step=20,
        metrics={"val/loss": 0.2},
    )

    saved = load_checkpoint(tmp_path / "last.pt")[STATE_KEY]
    assert saved == {
        "monitor": "val/loss",
        "mode": "min",
        "best_value": 0.2,
        "best_epoch": 2,
        "best_step": 20,
    }
    resumed = Checkpointer(tmp_path)
    resumed.load_state_dict(saved)
    resumed.save(state_for(3), epoch=3, step=30, metrics={"val/loss": 0.3})
    assert saved_epoch(tmp_path / "best.pt") == 2


def test_state_of_another_monitor_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old = Checkpointer(tmp_path)
    old.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 0.1})

    new = Checkpointer(tmp_path, monitor="val/accuracy", mode="max")
    new.load_state_dict(old.state_dict())

    assert new.best_value is None
    assert "starting best tracking afresh" in caplog.text


def test_load_state_dict_rejects_something_else(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="Not a Checkpointer state"):
        Checkpointer(tmp_path).load_state_dict({"model": {}})


def test_reserved_state_key_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="reserves"):
        Checkpointer(tmp_path).save({STATE_KEY: "mine"}, epoch=1, step=1, metrics={"val/loss": 1.0})


def test_missing_monitor_key_names_it_and_the_keys_present(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, monitor="val/loss")

    with pytest.raises(CheckpointError) as info:
        ckpt.save(state_for(1), epoch=1, step=1, metrics={"train/loss": 1.0, "lr": 0.1})

    assert "'val/loss'" in info.value.message
    assert "lr, train/loss" in info.value.message
    assert info.value.hint is not None and "train.monitor" in info.value.hint
    assert list(tmp_path.iterdir()) == []


def test_without_keep_best_no_metric_is_needed_and_no_best_is_written(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_best=False)
    ckpt.save(state_for(1), epoch=1, step=1, metrics={})

    assert ckpt.best_path is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [epoch_name(1, 1), "last.pt"]


def test_a_failed_save_rotates_nothing_and_keeps_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=1)
    ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 1.0})

    def no_space(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", no_space)
    with pytest.raises(CheckpointError, match="No space left on device"):
        ckpt.save(state_for(2), epoch=2, step=2, metrics={"val/loss": 0.5})
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", epoch_name(1, 1), "last.pt"]
    assert saved_epoch(tmp_path / "last.pt") == 1
    assert ckpt.best_value == 1.0


def test_the_file_just_saved_is_kept_even_if_older_files_rank_higher(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path, keep_last=1, keep_best=False)
    ckpt.save(state_for(9), epoch=9, step=900, metrics={})
    # Resumed from an earlier point: the new file has a lower (epoch, step).
    path = ckpt.save(state_for(2), epoch=2, step=200, metrics={})

    assert sorted(p.name for p in tmp_path.iterdir()) == [epoch_name(2, 200), "last.pt"]
    assert saved_epoch(path) == 2


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_keep_last_below_one_is_an_error(tmp_path: Path, keep_last: Any) -> None:
    with pytest.raises(CheckpointError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=keep_last)


def test_unknown_mode_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="'min' or 'max'") as info:
        Checkpointer(tmp_path, mode="lowest")  # type: ignore[arg-type]

    assert info.value.hint is not None and "train.monitor_mode" in info.value.hint


def test_folder_is_created(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path / "run" / "checkpoints")

    assert ckpt.directory.is_dir()
    assert ckpt.last_path is None


def test_find_latest_in_a_run_dir_and_in_the_checkpoints_folder(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    ckpt = Checkpointer(folder)
    for epoch in (1, 2):
        ckpt.save(state_for(epoch), epoch=epoch, step=epoch, metrics={"val/loss": 1.0})

    assert find_latest(tmp_path) == folder / "last.pt"
    assert find_latest(folder) == folder / "last.pt"
    assert Checkpointer.find_latest(str(tmp_path)) == folder / "last.pt"


def test_find_latest_without_last_pt_takes_the_highest_epoch_and_step(tmp_path: Path) -> None:
    for name in (epoch_name(9999, 5), epoch_name(10000, 1), epoch_name(10000, 0), "other.pt"):
        (tmp_path / name).write_bytes(b"x")

    assert find_latest(tmp_path) == tmp_path / epoch_name(10000, 1)


def test_find_latest_returns_none_when_there_is_nothing(tmp_path: Path) -> None:
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "missing") is None
