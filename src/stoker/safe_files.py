"""Writing files in a run dir without trusting what is already there (links, FIFOs).

A run dir may be shared, copied from elsewhere or prepared by someone else, and
``--resume`` writes into it. A file in it that is a symbolic link (``metrics.jsonl ->
~/.bashrc``) would make an append or an overwrite land outside the run dir; a hard link
does the same to the file it shares; a FIFO would block the run forever. So every file
stoker writes or appends to in a run dir goes through this module: the final name is
opened with ``O_NOFOLLOW`` (never through a link), must be a regular file with one link,
and a whole-file write goes to a fresh scratch file (``O_EXCL``) renamed over the target.

Folders are followed on purpose: ``checkpoints -> /big-disk/run-7`` is how a run puts
its checkpoints on another disk, and only the person who made the run dir can make it so.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import IO, Any

from stoker.errors import StokerError

__all__ = [
    "RunFileError",
    "check_not_link",
    "describe_os_error",
    "format_bytes",
    "free_bytes",
    "open_append",
    "open_fd",
    "write_text",
]

# O_NOFOLLOW does not exist on Windows, where making a symlink needs an admin anyway.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
# A full disk and a spent quota: the same fix, more free bytes.
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


class RunFileError(StokerError):
    """A file in a run dir cannot be written: a link, not a regular file, or a full disk."""


def describe_os_error(exc: OSError, folder: Path, *, needed: int | None = None) -> tuple[str, str]:
    """``(reason, fix)`` for an OS failure writing into ``folder``, named as what it is.

    A full disk (ENOSPC), a spent quota (EDQUOT) and a read-only file system (EROFS) say
    so in words, with the bytes the write needed (``needed``) and what is free there.
    """
    code = errno.errorcode.get(exc.errno or 0, "")
    strerror = exc.strerror or str(exc)
    if exc.errno in _FULL:
        what = "disk full" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        reason = f"{what}: {strerror} ({code})"
        if needed is not None:
            reason += f": the write needs about {format_bytes(needed)}"
            free = free_bytes(folder)
            if free is not None:
                reason += f", {format_bytes(free)} free on the disk that holds {folder}"
        fix = f"free space on the disk that holds {folder}" + (
            " (or in your quota there)" if exc.errno != errno.ENOSPC else ""
        )
        return reason, fix
    if exc.errno == errno.EROFS:
        return (
            f"read-only file system: {strerror} ({code})",
            f"{folder} is on a read-only file system: remount it read-write, or write the "
            "run to another folder",
        )
    reason = f"{strerror} ({code})" if code else strerror
    if exc.errno in (errno.EACCES, errno.EPERM):
        return reason, f"make {folder} writable, or write the run to another folder"
    if exc.errno == errno.ENOENT:
        return reason, f"create the folder {folder} first, or point the run at an existing one"
    return reason, f"check that {folder} exists, is writable and has free space"


def free_bytes(folder: Path) -> int | None:
    """Bytes free to this user on the disk that holds ``folder``; None if unknown."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def format_bytes(size: int) -> str:
    """``size`` for people: 512 B, 3.2 KiB, 41.0 MiB, 1.5 GiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _os_failure(path: Path, exc: OSError, *, needed: int | None = None) -> RunFileError:
    reason, fix = describe_os_error(exc, path.parent, needed=needed)
    return RunFileError(f"Could not write {path}: {reason}.", hint=fix)


def _refuse(path: Path, what: str) -> RunFileError:
    return RunFileError(
        f"{path} is {what}; stoker does not write through it, as the write would land "
        "outside the run dir",
        hint=f"remove {path} (stoker writes a new file there), or use another run dir",
    )


def check_not_link(path: str | os.PathLike[str]) -> None:
    """Raise :class:`RunFileError` when ``path`` is a symbolic link (dangling or not)."""
    path = Path(path)
    if path.is_symlink():
        raise _refuse(path, f"a symbolic link (to {os.readlink(path)})")


def open_fd(path: str | os.PathLike[str], flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags)`` that refuses a symlink, a hard-linked file or a non-file.

    The descriptor is close-on-exec (PEP 446 makes every fd so; said here for C callers)
    and blocking as usual; ``O_NONBLOCK`` is only used to open a FIFO without hanging.

    Raises:
        RunFileError: ``path`` is a symbolic link, a FIFO, device or folder, or a file
            with other hard links.
        OSError: Any other failure to open (no space, no permission).
    """
    path = Path(path)
    try:
        fd = os.open(path, flags | _NOFOLLOW | _NONBLOCK | _CLOEXEC, mode)
    except OSError as exc:
        # Linux says ELOOP for a final symlink under O_NOFOLLOW; the BSDs say EMLINK.
        if exc.errno in (errno.ELOOP, errno.EMLINK) and path.is_symlink():
            raise _refuse(path, f"a symbolic link (to {os.readlink(path)})") from None
        if exc.errno == errno.ENXIO and stat.S_ISFIFO(os.lstat(path).st_mode):
            raise _refuse(path, "a FIFO, not a regular file") from None
        if exc.errno == errno.EISDIR:
            raise _refuse(path, "a folder, not a file") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(path, "not a regular file (a FIFO, socket or device)")
        if info.st_nlink > 1:
            raise _refuse(path, f"a hard link to a file with {info.st_nlink} names")
        if _NONBLOCK:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: str | os.PathLike[str], *, binary: bool = False) -> IO[Any]:
    """``open(path, "a")`` (created if missing) that never writes through a link."""
    try:
        fd = open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError as exc:
        raise _os_failure(Path(path), exc) from exc
    if binary:
        return os.fdopen(fd, "ab")
    return os.fdopen(fd, "a", encoding="utf-8")


def write_text(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8), atomically, never writing through a link.

    The text goes to a fresh scratch file beside ``path`` (created exclusively, so a
    planted scratch name cannot redirect it) and is renamed over ``path``: a reader sees
    the old file or the new one, never half of one.

    Raises:
        RunFileError: ``path`` is a symbolic link, or writing failed (a full disk...);
            ``path`` is then left as it was.
    """
    path = Path(path)
    check_not_link(path)
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    data = text.encode("utf-8")
    try:
        fd = open_fd(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except OSError as exc:
        raise _os_failure(path, exc, needed=len(data)) from exc
    try:
        with os.fdopen(fd, "wb") as stream:
            stream.write(data)
        os.replace(scratch, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            scratch.unlink()
        if isinstance(exc, OSError):
            raise _os_failure(path, exc, needed=len(data)) from exc
        raise
