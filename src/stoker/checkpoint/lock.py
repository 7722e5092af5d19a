"""The lock that lets one Checkpointer at a time write into a checkpoints folder."""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import weakref
from pathlib import Path

from stoker.errors import CheckpointError
from stoker.safe_files import RunFileError, describe_os_error, open_fd

try:
    import fcntl
except ImportError:  # Windows: no flock; the folder is not locked there.
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "FolderLock"]

logger = logging.getLogger(__name__)

LOCK_FILE = ".lock"

#: The locks this process holds, for the fork hook below.
_HELD: weakref.WeakSet[FolderLock] = weakref.WeakSet()


def _close_in_child() -> None:
    for lock in list(_HELD):
        lock._forget_in_child()
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    # Every fork (DataLoader workers, a user's subprocess) drops its copy of the locks.
    os.register_at_fork(after_in_child=_close_in_child)


def _release(fd: int) -> None:
    # LOCK_UN releases the lock of the open file description, which forked children
    # (DataLoader workers) share, so a worker that outlives close() cannot keep it held.
    with contextlib.suppress(OSError):
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
    with contextlib.suppress(OSError):
        os.close(fd)


def _holder(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    if not text.isdigit():
        return "a process that did not record its pid"
    pid = int(text)
    if pid == os.getpid():
        return f"this process (pid {pid}), through another Checkpointer not yet closed"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"pid {pid}, which has exited, but a child process it started still holds it"
    except PermissionError:
        pass  # the process exists but belongs to another user
    return f"pid {pid}"


class FolderLock:
    """An exclusive ``flock`` on ``<folder>/.lock``, held until :meth:`release`.

    The lock file records the holder's pid, for the error a second writer gets. The kernel
    drops a flock when its process dies, so a crashed run never leaves a stale lock behind
    (the pid left in the file is then simply overwritten).
    """

    def __init__(self, folder: Path) -> None:
        """Takes the lock.

        Raises:
            CheckpointError: Another process (or another open Checkpointer in this one) holds
                it; the message names the pid.
        """
        self.path = folder / LOCK_FILE
        self._fd: int | None = None
        if fcntl is None:
            logger.debug("no fcntl on this platform; %s is not locked", folder)
            self._finalizer = None
            return
        try:
            # Never through a symlink: a planted `.lock -> ~/.bashrc` would be truncated.
            fd = open_fd(self.path, os.O_RDWR | os.O_CREAT)
        except RunFileError as exc:
            raise CheckpointError(exc.message, hint=exc.hint) from None
        except OSError as exc:
            reason, fix = describe_os_error(exc, folder)
            raise CheckpointError(
                f"Could not open the lock file {self.path}: {reason}.", hint=fix
            ) from exc
        if not self._try_lock(fd):
            # An unclosed Checkpointer of this process may only be waiting for the collector.
            if _holder(self.path).startswith("this process"):
                gc.collect()
            if not self._try_lock(fd):
                holder = _holder(self.path)
                os.close(fd)
                raise CheckpointError(
                    f"The checkpoint folder {folder} is locked by {holder}; only one "
                    "Checkpointer at a time may write into it.",
                    hint="wait for that run to end or stop it, or write this run to another "
                    "run dir; in one process, call close() on the first Checkpointer (or use "
                    "it in a `with` block)",
                )
        # The pid is only for the message a second writer gets; a full disk must not stop us.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        self._finalizer = weakref.finalize(self, _release, fd)
        _HELD.add(self)

    def _forget_in_child(self) -> None:
        """In a forked child: close this copy of the fd, without unlocking the parent's.

        A flock belongs to the open file description, which a fork shares; as long as any
        process has it open the lock stays held. A DataLoader worker orphaned by a kill -9
        of the training process would so keep the run locked until it noticed and exited,
        and an immediate resume would be refused. Closing (not LOCK_UN, which would unlock
        the parent too) leaves the lock to the parent alone, released when it dies.
        """
        if self._finalizer is not None and self._finalizer.detach() is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # type: ignore[arg-type]
        self._fd = None

    @staticmethod
    def _try_lock(fd: int) -> bool:
        assert fcntl is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    @property
    def held(self) -> bool:
        """Whether this object still holds the lock."""
        return self._finalizer is not None and self._finalizer.alive

    def release(self) -> None:
        """Releases the lock; calling it again does nothing."""
        if self._finalizer is not None:
            self._finalizer()
