"""Fault injection: damaged checkpoints (truncated, altered, unmarked, re-manifested) are caught."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from stoker.checkpoint import (
    Checkpointer,
    DamagedCheckpointError,
    find_latest,
    find_latest_valid,
    load_checkpoint,
    verify_checkpoint,
)


def name(step: int) -> str:
    return f"step-{step:08d}"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A checkpoints folder holding steps 1, 2 and 3."""
    with Checkpointer(tmp_path, keep_last=3, keep_best=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save({"step": step, "w": torch.arange(2000.0) * step}, epoch=step, step=step)
    return tmp_path


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-100])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def append(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0")


def edit_manifest(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["step"] = 999
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def rehash_manifest(path: Path) -> None:
    # Claims another digest for state.pt; the COMPLETE marker no longer matches.
    manifest = json.loads(path.read_text())
    manifest["files"]["state.pt"]["sha256"] = "0" * 64
    path.write_text(json.dumps(manifest))


def delete(path: Path) -> None:
    path.unlink()


def empty(path: Path) -> None:
    path.write_bytes(b"")


CASES: list[tuple[str, str, Callable[[Path], None], str]] = [
    ("truncate state", "state.pt", truncate, "state.pt is truncated: it has"),
    ("flip a byte", "state.pt", flip_a_byte, "state.pt was altered: its SHA-256 is"),
    ("grow the state", "state.pt", append, "state.pt has"),
    ("delete the state", "state.pt", delete, "state.pt is missing"),
    ("delete the marker", "COMPLETE", delete, "no COMPLETE marker, so its save did not finish"),
    ("empty the marker", "COMPLETE", empty, "manifest.json was changed after the save"),
    ("edit the manifest", "manifest.json", edit_manifest, "manifest.json was changed after"),
    ("rehash the manifest", "manifest.json", rehash_manifest, "manifest.json was changed"),
    ("truncate the manifest", "manifest.json", truncate, "manifest.json was changed"),
    ("delete the manifest", "manifest.json", delete, "manifest.json is missing"),
]


@pytest.mark.parametrize(
    ("file", "damage", "expected"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_damage_is_a_clear_error_and_resume_falls_back(
    folder: Path, file: str, damage: Callable[[Path], None], expected: str
) -> None:
    damaged = folder / name(3)
    damage(damaged / file)

    with pytest.raises(DamagedCheckpointError) as info:
        load_checkpoint(damaged)

    error = info.value
    assert expected in error.reason
    assert error.path == damaged
    assert error.message.startswith(f"Checkpoint {damaged} is damaged: ")
    assert error.hint is not None and "newest intact checkpoint" in error.hint
    # Through the pointer too: last.json names the damaged folder.
    with pytest.raises(DamagedCheckpointError, match=expected.split(":")[0]):
        load_checkpoint(folder / "last.json")
    # Resume skips it, says why, and takes the one before.
    latest, skipped = find_latest_valid(folder)
    assert latest == folder / name(2)
    assert len(skipped) == 1
    assert skipped[0][0] == damaged and expected in skipped[0][1]
    assert load_checkpoint(latest)["step"] == 2


def test_a_flipped_byte_names_both_digests(folder: Path) -> None:
    flip_a_byte(folder / name(3) / "state.pt")
    recorded = json.loads((folder / name(3) / "manifest.json").read_text())["files"]["state.pt"]

    with pytest.raises(DamagedCheckpointError) as info:
        verify_checkpoint(folder / name(3))

    assert recorded["sha256"][:16] in info.value.reason


def test_a_truncated_file_names_both_sizes(folder: Path) -> None:
    state = folder / name(3) / "state.pt"
    size = state.stat().st_size
    truncate(state)

    with pytest.raises(DamagedCheckpointError) as info:
        verify_checkpoint(folder / name(3))

    assert info.value.reason == (
        f"state.pt is truncated: it has {size - 100} bytes, manifest.json says {size}"
    )


def test_when_every_checkpoint_is_damaged_there_is_nothing_to_resume(folder: Path) -> None:
    for step in (1, 2, 3):
        truncate(folder / name(step) / "state.pt")

    latest, skipped = find_latest_valid(folder)

    assert latest is None
    assert [path.name for path, _ in skipped] == [name(3), name(2), name(1)]
    assert find_latest(folder) is None


def test_the_next_save_replaces_a_damaged_checkpoint(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (folder / name(3) / "COMPLETE").unlink()

    with caplog.at_level(logging.WARNING), Checkpointer(folder, keep_last=3) as ckpt:
        saved = ckpt.save({"step": 4}, epoch=4, step=4, metrics={"val/loss": 1.0})

    assert find_latest_valid(folder) == (saved, [])
    assert not (folder / name(3)).exists()
    assert f"removing damaged checkpoint {folder / name(3)}" in caplog.text
