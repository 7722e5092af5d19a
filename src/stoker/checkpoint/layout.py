"""The checkpoints folder of a run: checkpoint names, last/best pointers, lookup and loading.

Layout::

    checkpoints/
      .lock                  held (flock) by the one Checkpointer writing here; holds its pid
      step-00001200/         one checkpoint: state.pt, manifest.json, COMPLETE
      step-00001234/
      last.json              {"checkpoint": "step-00001234", ...}, replaced atomically
      best.json              the same for the best checkpoint
      .tmp-…                 a save, pointer or deletion in progress; ignored, removed by
                             the next save

A name read from a pointer file or found in the folder must be a checkpoint name
(``step-<digits>`` or ``step-<digits>-<n>``) and may not lead out of the folder through a
symlink; anything else is refused.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

from stoker.checkpoint.io import MapLocation, load_state_file
from stoker.checkpoint.manifest import (
    MANIFEST,
    MARKER,
    STATE_FILE,
    CheckpointInfo,
    DamagedCheckpointError,
    inspect_checkpoint,
    is_checkpoint_dir,
)
from stoker.errors import CheckpointError

__all__ = [
    "POINTERS",
    "TEMP_PREFIX",
    "checkpoint_name",
    "checkpoints_dir",
    "find_latest",
    "find_latest_valid",
    "is_checkpoint_name",
    "load_checkpoint",
    "read_pointer",
    "scan_checkpoints",
]

TEMP_PREFIX = ".tmp-"
POINTERS = {"last": "last.json", "best": "best.json"}
_NAME_RE = re.compile(r"step-(\d{8,})(?:-([1-9]\d*))?")

Pointer = Literal["last", "best"]


def is_checkpoint_name(name: object) -> bool:
    """Whether ``name`` is a checkpoint folder name: ``step-<8+ digits>``, maybe with ``-<n>``."""
    return isinstance(name, str) and bool(_NAME_RE.fullmatch(name))


def _name_key(path: Path) -> tuple[int, int, str]:
    """Orders checkpoint names by step, then repeat number (so step-100000000 > step-99999999)."""
    match = _NAME_RE.fullmatch(path.name)
    if match is None:
        return (-1, 0, path.name)
    return (int(match[1]), int(match[2] or 1), path.name)


def checkpoint_name(step: int, taken: set[str] | frozenset[str] = frozenset()) -> str:
    """``step-{step:08d}``, or ``step-{step:08d}-2``, ``-3``… if that name is taken."""
    base = f"step-{step:08d}"
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


def checkpoints_dir(path: str | Path) -> Path:
    """The checkpoints folder for a run dir (``<run dir>/checkpoints``) or that folder itself."""
    path = Path(path)
    return path / "checkpoints" if (path / "checkpoints").is_dir() else path


def _inside(directory: Path, name: str, *, source: str) -> Path:
    """``directory / name`` after checking that ``name`` cannot lead out of ``directory``."""
    if not is_checkpoint_name(name):
        raise CheckpointError(
            f"{source} names the checkpoint {name!r}, which is not a checkpoint folder name "
            "(step-<digits>); names with '/', '..' or an absolute path are refused.",
            hint=f"delete {source} (the next save writes it again) or fix the name in it",
        )
    path = directory / name
    if path.is_symlink():
        target = path.resolve()
        if not target.is_relative_to(directory.resolve()):
            raise CheckpointError(
                f"{path} ({source}) is a symlink to {target}, outside the checkpoints folder "
                f"{directory}; stoker does not follow it.",
                hint=f"remove the symlink {path}, or copy the checkpoint into {directory}",
            )
    return path


def _pointer_target(pointer_file: Path) -> Path:
    try:
        content: Any = json.loads(pointer_file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"Pointer file {pointer_file} cannot be read: {exc}.",
            hint=f"delete {pointer_file} (the next save writes it again) and load a "
            "checkpoint folder or the run dir instead",
        ) from exc
    name = content.get("checkpoint") if isinstance(content, dict) else None
    return _inside(pointer_file.parent, name, source=f"pointer file {pointer_file}")


def read_pointer(directory: str | Path, which: Pointer) -> Path | None:
    """The checkpoint folder that ``last.json`` or ``best.json`` names, if both exist.

    Raises:
        CheckpointError: The pointer file is unreadable or names a path outside the folder.
    """
    pointer_file = Path(directory) / POINTERS[which]
    if not pointer_file.is_file():
        return None
    target = _pointer_target(pointer_file)
    return target if target.is_dir() else None


def _is_checkpoint_entry(path: Path) -> bool:
    return is_checkpoint_name(path.name) and (path.is_dir() or path.is_symlink())


def scan_checkpoints(
    directory: Path,
) -> tuple[list[CheckpointInfo], list[tuple[Path, str]]]:
    """The checkpoint folders in ``directory`` by their manifests (sizes checked, not hashed).

    Returns:
        The healthy-looking checkpoints, newest first (by save sequence, then step), and the
        folders that are visibly damaged, with the reason.
    """
    healthy: list[CheckpointInfo] = []
    damaged: list[tuple[Path, str]] = []
    if not directory.is_dir():
        return healthy, damaged
    for path in sorted(directory.iterdir()):
        if not _is_checkpoint_entry(path):
            continue
        try:
            _inside(directory, path.name, source="the checkpoints folder")
            healthy.append(inspect_checkpoint(path, hash_files=False))
        except DamagedCheckpointError as exc:
            damaged.append((path, exc.reason))
        except CheckpointError as exc:
            damaged.append((path, exc.message))
    healthy.sort(key=lambda info: (info.sequence, info.step, info.path.name), reverse=True)
    return healthy, damaged


def find_latest_valid(
    directory_or_run_dir: str | Path,
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """Finds the newest checkpoint that verifies, and says which newer ones were skipped.

    Checkpoints are ordered by when they were saved (the manifest's sequence number), not by
    step, so a run resumed from an earlier point continues from its own newest save. The
    newest is verified in full (every byte hashed); if it is damaged the next is tried.

    Args:
        directory_or_run_dir: A run dir, its ``checkpoints/`` folder, or one checkpoint folder.

    Returns:
        The checkpoint folder (None if there is no intact one), and the damaged checkpoints
        passed over (highest step first), each with the reason, e.g. to print "checkpoint X
        is damaged (reason), resuming from Y". Folders that cannot even be ordered (no
        marker, unreadable manifest, wrong sizes) are always listed as skipped. ``.tmp-*``
        folders are ignored.
    """
    path = Path(directory_or_run_dir)
    if is_checkpoint_dir(path) and not (path / "checkpoints").is_dir():
        try:
            inspect_checkpoint(path)
        except DamagedCheckpointError as exc:
            return None, [(path, exc.reason)]
        return path, []
    directory = checkpoints_dir(path)
    healthy, skipped = scan_checkpoints(directory)
    found = None
    for info in healthy:
        try:
            inspect_checkpoint(info.path)
        except DamagedCheckpointError as exc:
            skipped.append((info.path, exc.reason))
            continue
        found = info.path
        break
    # Names sort by step; newest first reads best in a "skipping X, Y" message.
    return found, sorted(skipped, key=lambda item: _name_key(item[0]), reverse=True)


def find_latest(directory_or_run_dir: str | Path) -> Path | None:
    """The newest checkpoint folder that verifies, or None; see :func:`find_latest_valid`."""
    return find_latest_valid(directory_or_run_dir)[0]


def _listing(directory: Path) -> str:
    if not directory.is_dir():
        return f"the folder {directory} does not exist either; check the run dir"
    names = [p.name for p in sorted(directory.iterdir(), key=_name_key) if _is_checkpoint_entry(p)]
    if not names:
        return f"{directory} holds no checkpoint folders (step-*); check the path"
    shown = ", ".join(names[-8:])
    if len(names) > 8:
        shown = f"({len(names) - 8} older), " + shown
    return f"checkpoints in {directory}: {shown}"


def _checkpoint_folder(path: Path) -> Path:
    """The checkpoint folder meant by ``path``: the folder, a pointer file, or a file in it."""
    if path.is_file():
        if path.suffix == ".json" and path.name != MANIFEST:
            target = _pointer_target(path)
            if not target.is_dir():
                raise CheckpointError(
                    f"Pointer file {path} names {target.name}, which does not exist.",
                    hint=f"resume from the run dir instead; {_listing(path.parent)}",
                )
            return target
        if path.name in (STATE_FILE, MANIFEST, MARKER) or is_checkpoint_dir(path.parent):
            return path.parent
        raise CheckpointError(
            f"{path} is a single file, not a stoker checkpoint (a folder such as "
            f"step-00001234/ holding {STATE_FILE}, {MANIFEST} and {MARKER}).",
            hint="pass a checkpoint folder, a run dir's checkpoints/last.json, or load a "
            "plain torch file safely with stoker.checkpoint.load_state_file",
        )
    if path.is_dir():
        if is_checkpoint_dir(path):
            return path
        directory = checkpoints_dir(path)
        raise CheckpointError(
            f"{path} is not one checkpoint but a folder of them (or of nothing).",
            hint=f"load find_latest({str(path)!r}) or {directory / POINTERS['last']}; "
            f"{_listing(directory)}",
        )
    raise CheckpointError(f"Checkpoint {path} does not exist.", hint=_listing(path.parent))


def load_checkpoint(
    path: str | Path, *, map_location: MapLocation = "cpu", verify: bool = True
) -> dict[str, Any]:
    """Verifies a checkpoint folder and loads its state with ``weights_only=True``.

    Args:
        path: A checkpoint folder (``checkpoints/step-00001234``), a pointer file
            (``checkpoints/last.json``) or the ``state.pt`` inside a checkpoint folder.
        map_location: Where to put the tensors, as for ``torch.load``.
        verify: Check the SHA-256 of every file against the manifest first; this reads the
            checkpoint's bytes once more. Turn it off only right after
            :func:`find_latest_valid` verified the same folder (the marker, the manifest
            and the file sizes are checked either way).

    Returns:
        The saved dict.

    Raises:
        CheckpointError: The path is not a checkpoint, the checkpoint is incomplete or
            damaged (:class:`DamagedCheckpointError`, naming the file and what differs), or
            it holds Python objects that would need unpickling.
    """
    folder = _checkpoint_folder(Path(path))
    # Without verify the marker, manifest, sizes and symlinks are still checked: that is cheap.
    inspect_checkpoint(folder, hash_files=verify)
    return load_state_file(folder / STATE_FILE, map_location=map_location)
