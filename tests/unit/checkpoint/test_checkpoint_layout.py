"""Tests for finding, verifying and loading checkpoint folders, and for paths that escape."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.checkpoint import (
    Checkpointer,
    DamagedCheckpointError,
    find_latest,
    find_latest_valid,
    load_checkpoint,
    save_atomic,
)
from stoker.checkpoint.layout import read_pointer
from stoker.errors import CheckpointError


def name(step: int) -> str:
    return f"step-{step:08d}"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A run dir whose checkpoints/ holds steps 1, 2 and 3 (best: step 1)."""
    with Checkpointer(tmp_path / "checkpoints", keep_last=3) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(
                {"step": step, "w": torch.full((4,), float(step))},
                epoch=step,
                step=step,
                metrics={"val/loss": float(step)},
            )
    return tmp_path


def rewrite_manifest(folder: Path, change: Any) -> None:
    """Edits manifest.json and re-signs COMPLETE, as an attacker who knows the format would."""
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    data = json.dumps(manifest).encode()
    (folder / "manifest.json").write_bytes(data)
    (folder / "COMPLETE").write_text(hashlib.sha256(data).hexdigest() + "\n")


@pytest.mark.parametrize(
    "how", ["folder", "folder-str", "last.json", "best.json", "state.pt", "manifest.json"]
)
def test_load_checkpoint_accepts_a_folder_a_pointer_or_a_file_in_it(
    run_dir: Path, how: str
) -> None:
    folder = run_dir / "checkpoints"
    path: Any = {
        "folder": folder / name(3),
        "folder-str": str(folder / name(3)),
        "last.json": folder / "last.json",
        "best.json": folder / "best.json",
        "state.pt": folder / name(3) / "state.pt",
        "manifest.json": folder / name(3) / "manifest.json",
    }[how]

    state = load_checkpoint(path)

    step = 1 if how == "best.json" else 3
    assert state["step"] == step
    assert torch.equal(state["w"], torch.full((4,), float(step)))
    assert state["checkpointer"]["best_checkpoint"] == name(1)


@pytest.mark.parametrize("which", ["run dir", "checkpoints"])
def test_a_folder_of_checkpoints_is_not_one_checkpoint(run_dir: Path, which: str) -> None:
    path = run_dir if which == "run dir" else run_dir / "checkpoints"

    with pytest.raises(CheckpointError, match="not one checkpoint") as info:
        load_checkpoint(path)

    assert info.value.hint is not None
    assert "find_latest" in info.value.hint
    assert name(3) in info.value.hint


def test_a_single_torch_file_is_not_a_checkpoint_folder(tmp_path: Path) -> None:
    path = save_atomic({"a": 1}, tmp_path / "weights.pt")

    with pytest.raises(CheckpointError, match="single file") as info:
        load_checkpoint(path)

    assert info.value.hint is not None and "load_state_file" in info.value.hint


def test_a_missing_checkpoint_lists_the_ones_there(run_dir: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist") as info:
        load_checkpoint(run_dir / "checkpoints" / name(9))

    assert info.value.hint is not None and name(2) in info.value.hint


def test_find_latest_valid_takes_the_newest_save_and_reports_nothing(run_dir: Path) -> None:
    assert find_latest_valid(run_dir) == (run_dir / "checkpoints" / name(3), [])
    assert find_latest_valid(run_dir / "checkpoints" / name(2)) == (
        run_dir / "checkpoints" / name(2),
        [],
    )


def test_find_latest_valid_skips_damaged_newer_ones_with_the_reason(run_dir: Path) -> None:
    folder = run_dir / "checkpoints"
    (folder / name(3) / "COMPLETE").unlink()
    state = folder / name(2) / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])

    latest, skipped = find_latest_valid(run_dir)

    assert latest == folder / name(1)
    assert [path.name for path, _ in skipped] == [name(3), name(2)]
    assert "no COMPLETE marker" in skipped[0][1]
    assert "state.pt is truncated" in skipped[1][1]
    assert find_latest(run_dir) == folder / name(1)


def test_find_latest_valid_of_a_damaged_checkpoint_folder(run_dir: Path) -> None:
    folder = run_dir / "checkpoints" / name(2)
    (folder / "manifest.json").unlink()

    latest, skipped = find_latest_valid(folder)

    assert latest is None
    assert skipped == [(folder, "manifest.json is missing")]


def test_temp_folders_are_ignored(run_dir: Path) -> None:
    folder = run_dir / "checkpoints"
    shutil.copytree(folder / name(3), folder / ".tmp-step-00000009-abcd")

    assert find_latest_valid(run_dir) == (folder / name(3), [])


def test_verify_false_still_checks_marker_and_sizes(run_dir: Path) -> None:
    folder = run_dir / "checkpoints" / name(3)
    state = folder / "state.pt"
    state.write_bytes(state.read_bytes()[:-1])

    with pytest.raises(DamagedCheckpointError, match="truncated"):
        load_checkpoint(folder, verify=False)


@pytest.mark.parametrize(
    "target",
    ["..", "../outside", "/etc", "/tmp/step-00000001", f"{name(1)}/../..", f"{name(1)}/state.pt"],
)
def test_a_pointer_cannot_lead_out_of_the_folder(run_dir: Path, target: str) -> None:
    folder = run_dir / "checkpoints"
    (folder / "last.json").write_text(json.dumps({"checkpoint": target}))

    with pytest.raises(CheckpointError, match="not a checkpoint folder name") as info:
        load_checkpoint(folder / "last.json")

    assert "last.json" in info.value.message
    with pytest.raises(CheckpointError):
        read_pointer(folder, "last")


@pytest.mark.parametrize("content", ["{", "[]", '{"checkpoint": 3}', ""])
def test_a_broken_pointer_file_is_a_clear_error(run_dir: Path, content: str) -> None:
    pointer = run_dir / "checkpoints" / "best.json"
    pointer.write_text(content)

    with pytest.raises(CheckpointError, match="best.json"):
        load_checkpoint(pointer)


def test_a_symlinked_checkpoint_outside_the_folder_is_refused(
    run_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = run_dir / "checkpoints"
    elsewhere = tmp_path_factory.mktemp("elsewhere") / name(7)
    shutil.copytree(folder / name(3), elsewhere)
    (folder / name(7)).symlink_to(elsewhere, target_is_directory=True)
    (folder / "last.json").write_text(json.dumps({"checkpoint": name(7)}))

    with pytest.raises(CheckpointError, match="outside the checkpoints folder"):
        load_checkpoint(folder / "last.json")
    latest, skipped = find_latest_valid(run_dir)
    assert latest == folder / name(3)
    assert [(path.name, "outside the checkpoints folder" in why) for path, why in skipped] == [
        (name(7), True)
    ]


def test_a_symlink_inside_the_folder_is_followed(run_dir: Path) -> None:
    folder = run_dir / "checkpoints"
    (folder / name(8)).symlink_to(folder / name(2), target_is_directory=True)
    (folder / "best.json").write_text(json.dumps({"checkpoint": name(8)}))

    assert load_checkpoint(folder / "best.json")["step"] == 2


def test_a_state_file_symlinked_out_of_the_checkpoint_is_refused(
    run_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    folder = run_dir / "checkpoints" / name(3)
    outside = tmp_path_factory.mktemp("outside") / "state.pt"
    shutil.move(folder / "state.pt", outside)
    (folder / "state.pt").symlink_to(outside)

    with pytest.raises(DamagedCheckpointError, match="outside the checkpoint folder") as info:
        load_checkpoint(folder)

    assert str(outside) in info.value.message


@pytest.mark.parametrize("listed", ["../state.pt", "/etc/passwd", "sub/state.pt", ".."])
def test_a_manifest_cannot_name_files_outside_the_checkpoint(run_dir: Path, listed: str) -> None:
    folder = run_dir / "checkpoints" / name(3)

    def add_file(manifest: dict[str, Any]) -> None:
        manifest["files"][listed] = dict(manifest["files"]["state.pt"])

    rewrite_manifest(folder, add_file)

    with pytest.raises(DamagedCheckpointError, match="not a plain file name") as info:
        load_checkpoint(folder)

    assert repr(listed) in info.value.message


def test_a_manifest_of_another_version_is_refused(run_dir: Path) -> None:
    folder = run_dir / "checkpoints" / name(3)
    rewrite_manifest(folder, lambda manifest: manifest.update(version=99))

    with pytest.raises(DamagedCheckpointError, match="version 99"):
        load_checkpoint(folder)
