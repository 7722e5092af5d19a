"""Tests for the Checkpointer: folders, last/best pointers, rotation, best on resume, the lock."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.checkpoint import Checkpointer, find_latest, load_checkpoint, verify_checkpoint
from stoker.checkpoint.store import STATE_KEY
from stoker.errors import CheckpointError


def state_for(epoch: int) -> dict[str, Any]:
    return {"epoch": epoch, "w": torch.full((3,), float(epoch))}


def name(step: int) -> str:
    return f"step-{step:08d}"


def saved_epoch(path: Path) -> int:
    state = load_checkpoint(path)
    assert torch.equal(state["w"], torch.full((3,), float(state["epoch"])))
    return state["epoch"]


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def pointer(folder: Path, which: str) -> dict[str, Any]:
    return json.loads((folder / f"{which}.json").read_text())


@pytest.fixture
def checkpointers():
    """Makes Checkpointers and closes them at the end, so no test leaks a lock."""
    made: list[Checkpointer] = []

    def make(*args: Any, **kwargs: Any) -> Checkpointer:
        ckpt = Checkpointer(*args, **kwargs)
        made.append(ckpt)
        return ckpt

    yield make
    for ckpt in made:
        ckpt.close()


@pytest.mark.parametrize(
    ("mode", "values", "best_epoch"),
    [
        ("min", [0.5, 0.3, 0.4, 0.35, 0.6], 2),
        ("max", [0.1, 0.4, 0.9, 0.2, 0.3], 3),
    ],
)
def test_keep_last_two_after_five_saves_keeps_the_best_too(
    tmp_path: Path, checkpointers: Any, mode: Any, values: list[float], best_epoch: int
) -> None:
    ckpt = checkpointers(tmp_path, keep_last=2, monitor="val/metric", mode=mode)
    written = []
    for epoch, value in enumerate(values, start=1):
        written.append(
            ckpt.save(
                state_for(epoch), epoch=epoch, step=epoch * 100, metrics={"val/metric": value}
            )
        )

    assert written[-1] == tmp_path / name(500)
    assert listing(tmp_path) == sorted(
        [".lock", "best.json", "last.json", name(400), name(500), name(best_epoch * 100)]
    )
    assert ckpt.last_path == tmp_path / name(500)
    assert ckpt.best_path == tmp_path / name(best_epoch * 100)
    assert saved_epoch(tmp_path / "last.json") == 5
    assert saved_epoch(tmp_path / "best.json") == best_epoch
    assert pointer(tmp_path, "best") == {
        "checkpoint": name(best_epoch * 100),
        "epoch": best_epoch,
        "step": best_epoch * 100,
    }
    assert ckpt.best_value == values[best_epoch - 1]


@pytest.mark.parametrize("keep_last", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rotation_keeps_exactly_the_newest_k_and_the_best(
    tmp_path: Path, checkpointers: Any, keep_last: int, seed: int
) -> None:
    rng = random.Random(seed)
    ckpt = checkpointers(tmp_path, keep_last=keep_last)
    saved: list[tuple[int, float]] = []
    for step in range(1, 9):
        loss = rng.choice([math.nan, rng.random()])
        ckpt.save(state_for(step), epoch=step, step=step, metrics={"val/loss": loss})
        saved.append((step, loss))
        finite = [(loss, step) for step, loss in saved if not math.isnan(loss)]
        expected = {name(step) for step, _ in saved[-keep_last:]}
        if finite:
            expected.add(name(min(finite)[1]))
        assert {p.name for p in tmp_path.glob("step-*")} == expected
        assert ckpt.last_path == tmp_path / name(step)


def test_each_checkpoint_folder_has_state_manifest_and_marker(
    tmp_path: Path, checkpointers: Any
) -> None:
    ckpt = checkpointers(tmp_path)
    folder = ckpt.save(state_for(1), epoch=1, step=10, metrics={"val/loss": 0.5, "lr": 0.1})

    assert folder == tmp_path / name(10)
    assert listing(folder) == ["COMPLETE", "manifest.json", "state.pt"]
    manifest_bytes = (folder / "manifest.json").read_bytes()
    manifest = json.loads(manifest_bytes)
    state_bytes = (folder / "state.pt").read_bytes()
    assert manifest["files"] == {
        "state.pt": {"bytes": len(state_bytes), "sha256": hashlib.sha256(state_bytes).hexdigest()}
    }
    assert (manifest["epoch"], manifest["step"], manifest["sequence"]) == (1, 10, 1)
    assert manifest["metrics"] == {"val/loss": 0.5, "lr": 0.1}
    assert (folder / "COMPLETE").read_text() == hashlib.sha256(manifest_bytes).hexdigest() + "\n"
    assert verify_checkpoint(folder).step == 10


def test_saving_hashes_while_writing_and_never_reads_the_file_back(
    tmp_path: Path, checkpointers: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = checkpointers(tmp_path)
    real_open = open
    read_back: list[str] = []

    def spy_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if str(file).endswith("state.pt") and "r" in mode:
            read_back.append(str(file))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy_open)
    ckpt.save({"w": torch.randn(1000)}, epoch=1, step=1, metrics={"val/loss": 1.0})
    monkeypatch.undo()

    assert read_back == []
    verify_checkpoint(tmp_path / name(1))


def test_nan_is_never_the_best(tmp_path: Path, checkpointers: Any) -> None:
    ckpt = checkpointers(tmp_path)
    ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": math.nan})
    assert ckpt.best_path is None
    assert ckpt.best_value is None
    assert not (tmp_path / "best.json").exists()

    ckpt.save(state_for(2), epoch=2, step=2, metrics={"val/loss": 2.0})
    ckpt.save(state_for(3), epoch=3, step=3, metrics={"val/loss": math.nan})

    assert ckpt.best_value == 2.0
    assert saved_epoch(tmp_path / "best.json") == 2
    assert saved_epoch(tmp_path / "last.json") == 3


def test_best_survives_state_dict_into_a_fresh_checkpointer(
    tmp_path: Path, checkpointers: Any
) -> None:
    first = checkpointers(tmp_path, keep_last=1)
    for epoch, loss in [(1, 0.1), (2, 0.3), (3, 0.5)]:
        first.save(state_for(epoch), epoch=epoch, step=epoch, metrics={"val/loss": loss})
    state = first.state_dict()
    first.close()

    resumed = checkpointers(tmp_path, keep_last=1)
    resumed.load_state_dict(state)
    assert resumed.best_value == 0.1
    resumed.save(state_for(4), epoch=4, step=4, metrics={"val/loss": 0.2})

    # keep_last=1 keeps the newest; the best (epoch 1) is protected from rotation.
    assert {p.name for p in tmp_path.glob("step-*")} == {name(1), name(4)}
    assert saved_epoch(tmp_path / "best.json") == 1
    assert resumed.state_dict() == {
        "monitor": "val/loss",
        "mode": "min",
        "best_value": 0.1,
        "best_epoch": 1,
        "best_step": 1,
        "best_checkpoint": name(1),
    }


def test_each_checkpoint_holds_the_state_after_its_own_save(
    tmp_path: Path, checkpointers: Any
) -> None:
    ckpt = checkpointers(tmp_path)
    ckpt.save(state_for(1), epoch=1, step=10, metrics={"val/loss": 0.5})
    # The caller's copy of the state is from before this save, when epoch 1 was the best.
    ckpt.save(
        {**state_for(2), STATE_KEY: ckpt.state_dict()},
        epoch=2,
        step=20,
        metrics={"val/loss": 0.2},
    )
    ckpt.close()

    saved = load_checkpoint(tmp_path / "last.json")[STATE_KEY]
    assert saved == {
        "monitor": "val/loss",
        "mode": "min",
        "best_value": 0.2,
        "best_epoch": 2,
        "best_step": 20,
        "best_checkpoint": name(20),
    }
    resumed = checkpointers(tmp_path)
    resumed.load_state_dict(saved)
    resumed.save(state_for(3), epoch=3, step=30, metrics={"val/loss": 0.3})
    assert saved_epoch(tmp_path / "best.json") == 2


def test_a_stale_best_pointer_is_repaired_on_the_next_save(
    tmp_path: Path, checkpointers: Any
) -> None:
    ckpt = checkpointers(tmp_path, keep_last=1)
    ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 0.5})
    old_best = (tmp_path / "best.json").read_bytes()
    ckpt.save(state_for(2), epoch=2, step=2, metrics={"val/loss": 0.1})
    state = load_checkpoint(tmp_path / "last.json")[STATE_KEY]
    ckpt.close()
    # As if the save of step 2 was killed after its rename, before best.json was replaced.
    (tmp_path / "best.json").write_bytes(old_best)

    resumed = checkpointers(tmp_path, keep_last=1)
    resumed.load_state_dict(state)
    resumed.save(state_for(3), epoch=3, step=3, metrics={"val/loss": 0.9})

    assert resumed.best_path == tmp_path / name(2)
    assert {p.name for p in tmp_path.glob("step-*")} == {name(2), name(3)}


def test_state_of_another_monitor_is_dropped_with_a_warning(
    tmp_path: Path, checkpointers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    old = checkpointers(tmp_path)
    old.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 0.1})

    new = checkpointers(tmp_path / "other", monitor="val/accuracy", mode="max")
    new.load_state_dict(old.state_dict())

    assert new.best_value is None
    assert new.state_dict()["best_checkpoint"] is None
    assert "starting best tracking afresh" in caplog.text


def test_a_state_without_the_folder_name_still_loads(tmp_path: Path, checkpointers: Any) -> None:
    ckpt = checkpointers(tmp_path)
    ckpt.load_state_dict(
        {"monitor": "val/loss", "mode": "min", "best_value": 0.5, "best_epoch": 1, "best_step": 7}
    )
    assert ckpt.best_value == 0.5
    assert ckpt.state_dict()["best_checkpoint"] is None


@pytest.mark.parametrize("bad", ["../outside", "/etc", "step-00000001/../..", 7])
def test_a_crafted_best_name_in_a_state_is_ignored(
    tmp_path: Path, checkpointers: Any, bad: Any
) -> None:
    ckpt = checkpointers(tmp_path)
    ckpt.load_state_dict(
        {
            "monitor": "val/loss",
            "mode": "min",
            "best_value": 0.5,
            "best_epoch": 1,
            "best_step": 1,
            "best_checkpoint": bad,
        }
    )
    assert ckpt.state_dict()["best_checkpoint"] is None


def test_load_state_dict_rejects_something_else(tmp_path: Path, checkpointers: Any) -> None:
    with pytest.raises(CheckpointError, match="Not a Checkpointer state"):
        checkpointers(tmp_path).load_state_dict({"model": {}})


def test_reserved_state_key_is_refused(tmp_path: Path, checkpointers: Any) -> None:
    with pytest.raises(CheckpointError, match="reserves"):
        checkpointers(tmp_path).save(
            {STATE_KEY: "mine"}, epoch=1, step=1, metrics={"val/loss": 1.0}
        )


def test_missing_monitor_key_names_it_and_the_keys_present(
    tmp_path: Path, checkpointers: Any
) -> None:
    ckpt = checkpointers(tmp_path, monitor="val/loss")

    with pytest.raises(CheckpointError) as info:
        ckpt.save(state_for(1), epoch=1, step=1, metrics={"train/loss": 1.0, "lr": 0.1})

    assert "'val/loss'" in info.value.message
    assert "lr, train/loss" in info.value.message
    assert info.value.hint is not None and "train.monitor" in info.value.hint
    assert listing(tmp_path) == [".lock"]


def test_a_save_without_metrics_is_no_candidate_for_best(
    tmp_path: Path, checkpointers: Any
) -> None:
    ckpt = checkpointers(tmp_path, keep_last=1)
    ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 0.5})
    # Mid-epoch saves have no validation metrics.
    ckpt.save(state_for(1), epoch=1, step=2, metrics=None)
    ckpt.save(state_for(1), epoch=1, step=3)

    assert ckpt.best_value == 0.5
    assert ckpt.best_path == tmp_path / name(1)
    assert ckpt.last_path == tmp_path / name(3)
    assert {p.name for p in tmp_path.glob("step-*")} == {name(1), name(3)}
    assert json.loads((tmp_path / name(3) / "manifest.json").read_text())["metrics"] == {}


def test_without_keep_best_no_metric_is_needed_and_no_best_is_written(
    tmp_path: Path, checkpointers: Any
) -> None:
    ckpt = checkpointers(tmp_path, keep_best=False)
    ckpt.save(state_for(1), epoch=1, step=1, metrics={})

    assert ckpt.best_path is None
    assert listing(tmp_path) == [".lock", "last.json", name(1)]


def test_a_best_pointer_whose_folder_is_gone_is_removed(tmp_path: Path, checkpointers: Any) -> None:
    first = checkpointers(tmp_path, keep_last=1)
    first.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 0.1})
    first.close()

    # Resumed without best tracking: the old best is rotated away, and so is best.json.
    again = checkpointers(tmp_path, keep_last=1, keep_best=False)
    again.save(state_for(2), epoch=2, step=2, metrics={})

    assert listing(tmp_path) == [".lock", "last.json", name(2)]


def test_a_checkpoint_saved_at_a_lower_step_is_the_latest(
    tmp_path: Path, checkpointers: Any
) -> None:
    ckpt = checkpointers(tmp_path, keep_last=2, keep_best=False)
    ckpt.save(state_for(9), epoch=9, step=900, metrics={})
    # Resumed from an earlier point: the new folder has a lower step but is newer.
    path = ckpt.save(state_for(2), epoch=2, step=200, metrics={})

    assert find_latest(tmp_path) == path == tmp_path / name(200)
    ckpt.save(state_for(3), epoch=3, step=300, metrics={})
    assert {p.name for p in tmp_path.glob("step-*")} == {name(200), name(300)}


def test_a_step_saved_again_gets_a_new_folder_and_is_the_latest(
    tmp_path: Path, checkpointers: Any
) -> None:
    ckpt = checkpointers(tmp_path, keep_last=3, keep_best=False)
    ckpt.save(state_for(1), epoch=1, step=100, metrics={})
    again = ckpt.save(state_for(2), epoch=2, step=100, metrics={})

    assert again == tmp_path / f"{name(100)}-2"
    assert find_latest(tmp_path) == again
    assert saved_epoch(tmp_path / "last.json") == 2
    assert saved_epoch(tmp_path / name(100)) == 1


def test_leftover_temp_folders_are_removed_by_the_next_save_only(
    tmp_path: Path, checkpointers: Any
) -> None:
    (tmp_path / ".tmp-step-00000005-abcd").mkdir()
    (tmp_path / ".tmp-step-00000005-abcd" / "state.pt").write_bytes(b"half")
    (tmp_path / ".tmp-last-1234").write_text("{")

    ckpt = checkpointers(tmp_path)
    assert find_latest(tmp_path) is None
    assert (tmp_path / ".tmp-step-00000005-abcd").is_dir()
    ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 1.0})

    assert listing(tmp_path) == [".lock", "best.json", "last.json", name(1)]


def test_a_damaged_checkpoint_is_removed_by_rotation_with_a_warning(
    tmp_path: Path, checkpointers: Any, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = checkpointers(tmp_path, keep_last=3)
    ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 1.0})
    (tmp_path / name(1) / "COMPLETE").unlink()

    with caplog.at_level(logging.WARNING):
        ckpt.save(state_for(2), epoch=2, step=2, metrics={"val/loss": 1.0})

    assert {p.name for p in tmp_path.glob("step-*")} == {name(2)}
    assert "removing damaged checkpoint" in caplog.text
    assert "COMPLETE" in caplog.text


def test_a_symlink_out_of_the_folder_is_unlinked_never_followed(
    tmp_path: Path, checkpointers: Any
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / name(99)).symlink_to(outside, target_is_directory=True)

    ckpt = checkpointers(folder)
    assert find_latest(folder) is None
    ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 1.0})

    assert not (folder / name(99)).is_symlink()
    assert (outside / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("keep_last", [0, -1, 1.5, True])
def test_keep_last_below_one_is_an_error(tmp_path: Path, keep_last: Any) -> None:
    with pytest.raises(CheckpointError, match="keep_last"):
        Checkpointer(tmp_path, keep_last=keep_last)


def test_unknown_mode_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="'min' or 'max'") as info:
        Checkpointer(tmp_path, mode="lowest")  # type: ignore[arg-type]

    assert info.value.hint is not None and "train.monitor_mode" in info.value.hint


def test_folder_is_created(tmp_path: Path, checkpointers: Any) -> None:
    ckpt = checkpointers(tmp_path / "run" / "checkpoints")

    assert ckpt.directory.is_dir()
    assert ckpt.last_path is None
    assert ckpt.best_path is None


def test_find_latest_in_a_run_dir_and_in_the_checkpoints_folder(
    tmp_path: Path, checkpointers: Any
) -> None:
    folder = tmp_path / "checkpoints"
    ckpt = checkpointers(folder)
    for epoch in (1, 2):
        ckpt.save(state_for(epoch), epoch=epoch, step=epoch, metrics={"val/loss": 1.0})

    assert find_latest(tmp_path) == folder / name(2)
    assert find_latest(folder) == folder / name(2)
    assert Checkpointer.find_latest(str(tmp_path)) == folder / name(2)


def test_find_latest_returns_none_when_there_is_nothing(tmp_path: Path) -> None:
    assert find_latest(tmp_path) is None
    assert find_latest(tmp_path / "missing") is None


def test_a_second_checkpointer_on_the_folder_is_refused_naming_the_pid(
    tmp_path: Path, checkpointers: Any
) -> None:
    first = checkpointers(tmp_path)

    with pytest.raises(CheckpointError, match="locked by") as info:
        Checkpointer(tmp_path)

    assert f"pid {os.getpid()}" in info.value.message
    assert info.value.hint is not None and "close()" in info.value.hint
    assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    first.close()
    checkpointers(tmp_path).save(state_for(1), epoch=1, step=1, metrics={"val/loss": 1.0})


def test_close_and_with_release_the_lock_and_end_saving(tmp_path: Path) -> None:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state_for(1), epoch=1, step=1, metrics={"val/loss": 1.0})

    with pytest.raises(CheckpointError, match="closed"):
        ckpt.save(state_for(2), epoch=2, step=2, metrics={"val/loss": 1.0})
    ckpt.close()  # a second close is harmless
    Checkpointer(tmp_path).close()


def test_a_forgotten_checkpointer_does_not_block_the_next_one(tmp_path: Path) -> None:
    ckpt = Checkpointer(tmp_path)
    # A reference cycle keeps it alive until the cycle collector runs.
    ckpt.cycle = ckpt  # type: ignore[attr-defined]
    del ckpt

    again = Checkpointer(tmp_path)
    again.close()
    gc.collect()


def test_a_lock_file_left_by_a_dead_process_does_not_block(tmp_path: Path) -> None:
    (tmp_path / ".lock").write_text("999999999\n")

    with Checkpointer(tmp_path):
        assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())


def test_a_deferred_save_is_a_checkpoint_only_after_its_shards_and_marker(tmp_path):
    # write_first returning a callable: the shards are still being written (async_save).
    # The checkpoint is finished in the background; the caller's state may change meanwhile.
    import threading

    written = threading.Event()

    def write_first(temp, name):
        def finish():
            assert written.wait(10)
            (temp / "shard").write_bytes(b"weights")
            return {"shard_files": ["shard"]}

        return finish

    ckpt = Checkpointer(tmp_path, keep_last=1, monitor=None)
    ckpt.save(state_for(1), epoch=1, step=1)
    state = state_for(2)
    path = ckpt.save(state, epoch=2, step=2, write_first=write_first)
    assert ckpt.pending == path
    state["w"].add_(100)  # the next optimizer step, before the save finished
    assert not (path / "COMPLETE").exists() and find_latest(tmp_path) == tmp_path / name(1)
    written.set()
    assert ckpt.wait() == path and ckpt.pending is None and ckpt.wait() is None
    assert saved_epoch(path) == 2  # the state as it was at save(), not after the step
    assert load_checkpoint(path)["shard_files"] == ["shard"]
    assert find_latest(tmp_path) == path and listing(tmp_path).count(name(1)) == 0  # rotated
    ckpt.close()


def test_a_failed_deferred_save_raises_at_wait_and_leaves_nothing(tmp_path):
    import errno

    def write_first(temp, name):
        def finish():
            (temp / "shard").write_bytes(b"half")
            raise OSError(errno.ENOSPC, "No space left on device")

        return finish

    ckpt = Checkpointer(tmp_path, keep_last=1, monitor=None)
    first = ckpt.save(state_for(1), epoch=1, step=1)
    ckpt.save(state_for(2), epoch=2, step=2, write_first=write_first)
    with pytest.raises(CheckpointError, match="disk full"):
        ckpt.wait()
    assert find_latest(tmp_path) == first and listing(tmp_path) == [".lock", "last.json", name(1)]
    # close() finishes a pending save too, logging (not raising) its failure.
    ckpt.save(state_for(3), epoch=3, step=3, write_first=write_first)
    ckpt.close()
    assert find_latest(tmp_path) == first
