"""One checkpoint folder: its state file, the manifest of SHA-256 digests, the COMPLETE marker."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stoker.checkpoint.io import HashingWriter, fsync_dir, write_durable
from stoker.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "MARKER",
    "STATE_FILE",
    "CheckpointInfo",
    "DamagedCheckpointError",
    "inspect_checkpoint",
    "is_checkpoint_dir",
    "verify_checkpoint",
    "write_checkpoint_files",
]

STATE_FILE = "state.pt"
MANIFEST = "manifest.json"
# Written last, after every other file and the folder are fsynced: no marker, no checkpoint.
MARKER = "COMPLETE"
FORMAT = "stoker-checkpoint"
VERSION = 1
_PLAIN_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20
_DAMAGED_HINT = (
    "resume from the run dir instead: stoker picks the newest intact checkpoint "
    "(stoker.checkpoint.find_latest_valid), or load an older checkpoint folder"
)


class DamagedCheckpointError(CheckpointError):
    """A checkpoint folder is incomplete, altered or truncated; ``reason`` says how."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"Checkpoint {path} is damaged: {reason}.", hint=_DAMAGED_HINT)
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class FileRecord:
    """What the manifest records about one file of a checkpoint."""

    size: int
    sha256: str


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint folder as its manifest describes it."""

    path: Path
    sequence: int
    epoch: int
    step: int
    files: Mapping[str, FileRecord]


def _plain_metrics(metrics: Mapping[str, Any]) -> dict[str, float | None]:
    plain: dict[str, float | None] = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float | torch.Tensor):
            continue
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            continue
        number = float(value)  # a CUDA tensor syncs here; once per checkpoint
        plain[str(key)] = number if math.isfinite(number) else None
    return plain


def write_checkpoint_files(
    folder: Path,
    state: Mapping[str, Any],
    *,
    sequence: int,
    epoch: int,
    step: int,
    metrics: Mapping[str, Any],
) -> None:
    """Fills the empty ``folder`` with state.pt, manifest.json and, last, COMPLETE.

    The state is hashed as ``torch.save`` writes it, so nothing is read back. Each file is
    fsynced, and the folder is fsynced before and after the marker is written.

    Raises:
        OSError: A write or fsync failed (the caller turns it into a CheckpointError).
        Exception: ``torch.save`` could not pickle the state.
    """
    with open(folder / STATE_FILE, "xb") as f:
        writer = HashingWriter(f)
        try:
            torch.save(dict(state), writer)
        except Exception as exc:
            if writer.error is not None:
                raise writer.error from exc  # a full disk, not a pickling problem
            raise
        f.flush()
        os.fsync(f.fileno())
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "sequence": sequence,
        "epoch": epoch,
        "step": step,
        "created_unix_s": round(time.time(), 3),
        "metrics": _plain_metrics(metrics),
        "files": {STATE_FILE: {"bytes": writer.size, "sha256": writer.hexdigest()}},
    }
    data = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    write_durable(folder / MANIFEST, data)
    fsync_dir(folder)
    # The marker holds the manifest's digest, so an edited manifest is caught too.
    write_durable(folder / MARKER, (hashlib.sha256(data).hexdigest() + "\n").encode())
    fsync_dir(folder)


def is_checkpoint_dir(path: Path) -> bool:
    """Whether ``path`` is a folder that looks like one checkpoint (intact or not)."""
    return path.is_dir() and any((path / name).exists() for name in (MANIFEST, MARKER, STATE_FILE))


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _int_field(manifest: Mapping[str, Any], key: str, folder: Path) -> int:
    value = manifest.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DamagedCheckpointError(
            folder, f"{MANIFEST} has no valid {key!r} (an integer >= 0), it has {value!r}"
        )
    return value


def _file_records(manifest: Mapping[str, Any], folder: Path) -> dict[str, FileRecord]:
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE_FILE not in files:
        raise DamagedCheckpointError(folder, f"{MANIFEST} does not list {STATE_FILE}")
    records: dict[str, FileRecord] = {}
    for name, entry in files.items():
        if (
            not isinstance(name, str)
            or not _PLAIN_NAME_RE.fullmatch(name)
            or name in (MANIFEST, MARKER)
        ):
            raise DamagedCheckpointError(
                folder,
                f"{MANIFEST} lists the file {name!r}, which is not a plain file name inside "
                "the checkpoint folder (no '..', no '/', not absolute)",
            )
        size = entry.get("bytes") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if (
            isinstance(size, bool)
            or not isinstance(size, int)
            or size < 0
            or not isinstance(digest, str)
            or not _SHA256_RE.fullmatch(digest)
        ):
            raise DamagedCheckpointError(
                folder, f"{MANIFEST} has no valid size and SHA-256 for {name}: {entry!r}"
            )
        records[name] = FileRecord(size=size, sha256=digest)
    return records


def _check_file(folder: Path, name: str, record: FileRecord, *, hash_files: bool) -> None:
    path = folder / name
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(folder.resolve()):
            raise DamagedCheckpointError(
                folder, f"{name} is a symlink to {target}, outside the checkpoint folder"
            )
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise DamagedCheckpointError(folder, f"{name} is missing ({MANIFEST} lists it)") from None
    if not path.is_file():
        raise DamagedCheckpointError(folder, f"{name} is not a regular file")
    if size < record.size:
        raise DamagedCheckpointError(
            folder, f"{name} is truncated: it has {size} bytes, {MANIFEST} says {record.size}"
        )
    if size > record.size:
        raise DamagedCheckpointError(
            folder, f"{name} has {size} bytes, {MANIFEST} says {record.size}"
        )
    if hash_files:
        actual = _sha256_of(path)
        if actual != record.sha256:
            raise DamagedCheckpointError(
                folder,
                f"{name} was altered: its SHA-256 is {actual[:16]}…, "
                f"{MANIFEST} records {record.sha256[:16]}…",
            )


def inspect_checkpoint(folder: Path, *, hash_files: bool = True) -> CheckpointInfo:
    """Checks one checkpoint folder against its manifest and marker.

    With ``hash_files`` (the default) every file is read and its SHA-256 compared with the
    manifest: this costs one read of the checkpoint's bytes. Without it only the marker, the
    manifest and the file sizes are checked (cheap; used to order and rotate checkpoints).

    Raises:
        DamagedCheckpointError: The folder is incomplete (no marker), its manifest was changed
            or is unreadable, or a file is missing, truncated, altered or outside the folder.
    """
    try:
        marker = (folder / MARKER).read_text().strip()
    except FileNotFoundError:
        raise DamagedCheckpointError(
            folder, f"it has no {MARKER} marker, so its save did not finish"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DamagedCheckpointError(folder, f"its {MARKER} marker cannot be read: {exc}") from exc
    try:
        data = (folder / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise DamagedCheckpointError(folder, f"{MANIFEST} is missing") from None
    except OSError as exc:
        raise DamagedCheckpointError(folder, f"{MANIFEST} cannot be read: {exc}") from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != marker:
        raise DamagedCheckpointError(
            folder,
            f"{MANIFEST} was changed after the save: its SHA-256 is {actual[:16]}…, "
            f"the {MARKER} marker records {marker[:16] or 'nothing'}…",
        )
    try:
        manifest = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DamagedCheckpointError(folder, f"{MANIFEST} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DamagedCheckpointError(folder, f"{MANIFEST} does not describe a stoker checkpoint")
    if manifest.get("version") != VERSION:
        raise DamagedCheckpointError(
            folder,
            f"{MANIFEST} has format version {manifest.get('version')!r}; this stoker reads "
            f"version {VERSION}",
        )
    info = CheckpointInfo(
        path=folder,
        sequence=_int_field(manifest, "sequence", folder),
        epoch=_int_field(manifest, "epoch", folder),
        step=_int_field(manifest, "step", folder),
        files=_file_records(manifest, folder),
    )
    for name, record in info.files.items():
        _check_file(folder, name, record, hash_files=hash_files)
    return info


def verify_checkpoint(folder: str | Path) -> CheckpointInfo:
    """Verifies a checkpoint folder: marker, manifest, and the SHA-256 of every file.

    Reads every byte of the checkpoint once (saving never reads it back: the digests are
    computed while writing).

    Raises:
        DamagedCheckpointError: What is wrong, naming the file and what differs.
    """
    return inspect_checkpoint(Path(folder), hash_files=True)
