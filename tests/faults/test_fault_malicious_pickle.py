"""Fault injection: a checkpoint whose pickle would run code is refused, and runs nothing."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.checkpoint import Checkpointer, find_latest_valid, load_checkpoint, verify_checkpoint
from stoker.errors import CheckpointError


class CreatesFileOnUnpickle:
    """Unpickling this calls open(target, "w"): a stand-in for arbitrary code in a pickle."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.target), "w"))


def assert_refused(path: Path, target: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path)

    assert not target.exists()
    assert "arbitrary Python objects" in info.value.message
    assert "open" in info.value.message
    assert info.value.hint is not None and "re-save the checkpoint" in info.value.hint


def test_a_verified_checkpoint_with_a_malicious_pickle_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "created-by-unpickling.txt"
    folder = tmp_path / "checkpoints"
    with Checkpointer(folder) as ckpt:
        # The hashes are right: integrity is not safety, weights_only is what protects.
        saved = ckpt.save(
            {"model": {}, "payload": CreatesFileOnUnpickle(target)},
            epoch=1,
            step=1,
            metrics={"val/loss": 1.0},
        )
    verify_checkpoint(saved)
    assert find_latest_valid(folder) == (saved, [])

    assert_refused(saved, target)
    assert_refused(folder / "last.json", target)
    # The payload is live: an unsafe load would have created the file.
    torch.load(saved / "state.pt", weights_only=False)
    assert target.exists()


def test_a_state_file_swapped_for_a_malicious_one_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "created-by-unpickling.txt"
    folder = tmp_path / "checkpoints"
    with Checkpointer(folder) as ckpt:
        saved = ckpt.save({"w": torch.ones(3)}, epoch=1, step=1, metrics={"val/loss": 1.0})
    # An attacker who swaps state.pt and rewrites the manifest and marker to match.
    torch.save({"w": torch.ones(3), "payload": CreatesFileOnUnpickle(target)}, saved / "state.pt")
    data = (saved / "state.pt").read_bytes()
    manifest = json.loads((saved / "manifest.json").read_text())
    manifest["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    manifest_bytes = json.dumps(manifest).encode()
    (saved / "manifest.json").write_bytes(manifest_bytes)
    (saved / "COMPLETE").write_text(hashlib.sha256(manifest_bytes).hexdigest())

    verify_checkpoint(saved)
    assert_refused(saved, target)
