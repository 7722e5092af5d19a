"""Atomic, durable file writes, hashing while writing, and safe (weights_only) file loads."""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import pickle
import re
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from stoker.errors import CheckpointError
from stoker.safe_files import describe_os_error

__all__ = [
    "HashingWriter",
    "MapLocation",
    "atomic_path",
    "fsync_dir",
    "listing_hint",
    "load_state_file",
    "os_error",
    "save_atomic",
    "state_bytes",
    "write_durable",
]

MapLocation = str | torch.device | Mapping[str, str] | Callable[..., Any] | None

_PLAIN_DATA = "tensors and plain data (dict, list, tuple, str, int, float, bool, None)"
_RESAVE_HINT = (
    f"re-save the checkpoint holding only {_PLAIN_DATA}: store `obj.state_dict()` instead of "
    "the object, and turn NumPy arrays or custom classes into tensors, lists or dicts"
)
# torch names the refused class as "GLOBAL module.qualname" in its weights_only message.
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


@functools.cache
def _umask() -> int:
    # The umask can only be read by setting it; do that once per process, not per save.
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable: a power cut cannot bring back the old entry."""
    # Makes the rename durable: without it a power cut can bring back the old directory entry.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # Windows cannot open a folder; NTFS journals the rename itself.
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems (and all of Windows) refuse fsync on a folder; that is not a failure.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def os_error(path: Path, what: str, exc: OSError, *, needed: int | None = None) -> CheckpointError:
    """A CheckpointError for an OS failure writing ``path``, with the fix for its errno.

    A full disk, a spent quota and a read-only file system are named as such, with the
    bytes the save needs (``needed``) and what is free (``stoker.safe_files``).
    """
    folder = path.parent
    reason, hint = describe_os_error(exc, folder, needed=needed)
    if exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        hint += ", or keep fewer checkpoints (checkpoint.keep_last)"
    return CheckpointError(f"Could not write {what} {path}: {reason}.", hint=hint)


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in a nested state: about what ``torch.save`` writes."""
    if isinstance(state, torch.Tensor):
        return state.untyped_storage().nbytes()
    if isinstance(state, Mapping):
        return sum(state_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(state_bytes(value) for value in state)
    return 64  # a number or a short string, with its pickle framing


@contextlib.contextmanager
def atomic_path(path: Path, *, what: str, hint: str | None = None) -> Iterator[Path]:
    """Yields a temporary path beside ``path``; on success, makes it durable and renames it.

    The body writes the temporary file by name. On leaving the block the file is fsynced,
    moved onto ``path`` with ``os.replace`` and the folder is fsynced, so ``path`` holds
    either the old content or the complete new content, never a partial write. On any
    failure before the rename the temporary file is removed and ``path`` is left untouched.

    Args:
        path: Final location of the file.
        what: Name of the thing written, for error messages ("checkpoint").
        hint: Fix shown when the body fails for a reason other than the OS (serialization).

    Raises:
        CheckpointError: The file could not be written; the message names the path and reason.
    """
    try:
        fd, name = tempfile.mkstemp(prefix=".tmp-", suffix=path.suffix, dir=path.parent)
    except OSError as exc:
        raise os_error(path, what, exc) from exc
    tmp = Path(name)
    try:
        try:
            # mkstemp makes 0600 files; give checkpoints the mode any other new file would get.
            os.chmod(fd if os.chmod in os.supports_fd else tmp, 0o666 & ~_umask())
        finally:
            os.close(fd)
        yield tmp
        with open(tmp, "r+b") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            raise
        if isinstance(exc, OSError):
            raise os_error(path, what, exc) from exc
        raise CheckpointError(
            f"Could not write {what} {path}: {type(exc).__name__}: {exc}", hint=hint
        ) from exc


class HashingWriter:
    """A write-only file object that hashes (SHA-256) and counts the bytes written through it.

    ``torch.save`` writes into it, so a checkpoint's digest is known when the write ends,
    without reading the file back.
    """

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self._sha256 = hashlib.sha256()
        self.size = 0
        #: The OS error a write met: torch.save reports it as a RuntimeError ("unexpected
        #: pos"), and the caller needs the errno to say "disk full".
        self.error: OSError | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` and hash it in the same pass; an OSError is kept in ``error``."""
        try:
            written = self._file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        # hashlib releases the GIL for large buffers; this is the only pass over the bytes.
        self._sha256.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        """Flush the file's buffer; the hash already holds every byte written."""
        self._file.flush()

    def hexdigest(self) -> str:
        """The SHA-256 of everything written so far, as hex."""
        return self._sha256.hexdigest()


def write_durable(path: Path, data: bytes) -> None:
    """Creates ``path`` (which must not exist), writes ``data`` and fsyncs it.

    On failure the partly written file is removed.
    """
    with open(path, "xb") as f:
        try:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise


def save_atomic(state: Mapping[str, Any], path: str | Path) -> Path:
    """Saves ``state`` with ``torch.save`` so that ``path`` is never left half-written.

    Args:
        state: What to save; load it back with :func:`load_state_file`, which accepts only
            tensors and plain Python data.
        path: The checkpoint file; its folder must exist.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        CheckpointError: Writing failed (no space, no permission, an object that cannot be
            pickled). Any file already at ``path`` is left as it was.
    """
    path = Path(path)
    payload = state if isinstance(state, dict) else dict(state)
    with atomic_path(path, what="checkpoint", hint=f"save only {_PLAIN_DATA}") as tmp:
        torch.save(payload, tmp)
    return path


def listing_hint(folder: Path, pattern: str = "*.pt", *, kind: str = "checkpoints") -> str:
    """Says which files matching ``pattern`` exist in ``folder``, for a "not found" hint."""
    if not folder.is_dir():
        return f"the folder {folder} does not exist either; check the run dir"
    names = sorted(p.name for p in folder.glob(pattern) if p.is_file())
    if not names:
        return f"{folder} holds no {kind} ({pattern}); check the path"
    shown = ", ".join(names[:8])
    if len(names) > 8:
        shown += f", ... ({len(names) - 8} more)"
    return f"{kind} in {folder}: {shown}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unpickling_error(path: Path, exc: pickle.UnpicklingError) -> CheckpointError:
    text = str(exc)
    names = sorted(set(_GLOBAL_RE.findall(text)))
    if names:
        return CheckpointError(
            f"Checkpoint {path} holds arbitrary Python objects ({', '.join(names)}); stoker "
            "refuses to unpickle it, because unpickling such a file can run any code.",
            hint=_RESAVE_HINT,
        )
    detail = next(
        (line.strip() for line in text.splitlines() if "WeightsUnpickler error" in line),
        _first_line(exc),
    )
    return CheckpointError(
        f"Checkpoint {path} cannot be loaded safely (weights_only): it is corrupt or holds "
        f"objects stoker will not unpickle. torch says: {detail}",
        hint=_RESAVE_HINT,
    )


def load_state_file(path: str | Path, *, map_location: MapLocation = "cpu") -> dict[str, Any]:
    """Loads one ``torch.save`` file with ``torch.load(..., weights_only=True)``, never unsafely.

    This reads a single file and checks no manifest; a run's checkpoints are folders, loaded
    (and verified) with :func:`stoker.checkpoint.load_checkpoint`.

    Args:
        path: The file.
        map_location: Where to put the tensors, as for ``torch.load``.

    Returns:
        The saved dict.

    Raises:
        CheckpointError: The file is missing, truncated or corrupt, holds Python objects that
            would need unpickling, or does not hold a dict.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder, not a single checkpoint file.",
            hint="load a checkpoint folder (step-*/) with stoker.checkpoint.load_checkpoint, "
            f"which verifies it; {listing_hint(path)}",
        )
    if not path.exists():
        raise CheckpointError(f"Checkpoint {path} does not exist.", hint=listing_hint(path.parent))
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _unpickling_error(path, exc) from exc
    except PermissionError as exc:
        raise CheckpointError(
            f"Cannot read checkpoint {path}: permission denied.",
            hint=f"make {path} readable by this user",
        ) from exc
    except Exception as exc:
        message = str(exc)
        if isinstance(exc, RuntimeError) and (
            "deserialize object on" in message or "restore data location" in message
        ):
            raise CheckpointError(
                f"Cannot place the tensors of {path} on map_location={map_location!r}: "
                f"{_first_line(exc)}",
                hint='load with map_location="cpu" and move the model to the device afterwards',
            ) from exc
        # torch surfaces a short or garbled file as RuntimeError, EOFError, OSError, KeyError...
        raise CheckpointError(
            f"Checkpoint {path} is truncated or not a checkpoint "
            f"({type(exc).__name__}: {_first_line(exc)}).",
            hint=f"its write was cut short or the file was damaged; load another one "
            f"({listing_hint(path.parent)})",
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(
            f"Checkpoint {path} holds a {type(state).__name__}, not a dict.",
            hint="save checkpoints as a dict, e.g. {'model': model.state_dict(), ...}",
        )
    return state
