"""The Checkpointer: writes checkpoint folders, moves the last/best pointers, rotates old ones."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import math
import os
import secrets
import shutil
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from stoker.checkpoint.io import fsync_dir, os_error, state_bytes, write_durable
from stoker.checkpoint.layout import (
    POINTERS,
    TEMP_PREFIX,
    Pointer,
    checkpoint_name,
    find_latest,
    is_checkpoint_name,
    read_pointer,
    scan_checkpoints,
)
from stoker.checkpoint.lock import FolderLock
from stoker.checkpoint.manifest import write_checkpoint_files
from stoker.checkpoint.renames import PointerBackup, remove_folder
from stoker.errors import CheckpointError

__all__ = ["STATE_KEY", "Checkpointer"]

logger = logging.getLogger(__name__)

# The key under which Checkpointer.save stores its own (post-save) state in each checkpoint.
STATE_KEY = "checkpointer"
_STATE_FIELDS = ("monitor", "mode", "best_value", "best_epoch", "best_step")
_PLAIN_DATA = "tensors and plain data (dict, list, tuple, str, int, float, bool, None)"


class Checkpointer:
    """Owns a checkpoints folder: writes checkpoint folders, moves last/best, rotates old ones.

    Each save writes ``step-{step:08d}/`` (``-2``, ``-3``… if a resumed run reaches a step
    again) holding ``state.pt``, ``manifest.json`` (the SHA-256 of every file, computed
    while writing) and, last, ``COMPLETE``. The folder is built as ``.tmp-…``, fsynced and
    renamed into place; then ``last.json`` (and ``best.json`` if it is the best) are replaced
    atomically; then old checkpoints are rotated: the newest ``keep_last`` (by save order)
    and the best are kept, everything else is removed. A failed save changes nothing.

    The folder is locked (``flock`` on ``.lock``) from construction until :meth:`close`, so
    a second writer, in another process or this one, is refused with the holder's pid.

    Each saved checkpoint also holds this object's state, as it is after that save, under
    ``STATE_KEY`` ("checkpointer"); on resume pass it to :meth:`load_state_dict` so that the
    best value so far (including the checkpoint resumed from) survives the restart.
    """

    find_latest = staticmethod(find_latest)

    def __init__(
        self,
        directory: str | Path,
        *,
        keep_last: int = 3,
        keep_best: bool = True,
        monitor: str | None = "val/loss",
        mode: Literal["min", "max"] = "min",
    ) -> None:
        """Creates the folder if it is missing and locks it.

        Args:
            directory: The checkpoints folder (usually ``<run dir>/checkpoints``).
            keep_last: How many of the newest checkpoints to keep; at least 1.
            keep_best: Whether to keep the best checkpoint (and ``best.json``); needs
                ``monitor``.
            monitor: The metric key that decides the best checkpoint; None turns best off.
            mode: "min" if a lower ``monitor`` value is better, "max" if higher is better.

        Raises:
            CheckpointError: An option is invalid, the folder cannot be created, or another
                Checkpointer holds its lock.
        """
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise CheckpointError(
                f"checkpoint.keep_last must be an integer >= 1, got {keep_last!r}.",
                hint="set checkpoint.keep_last to 1 or more (resuming needs one checkpoint)",
            )
        if mode not in ("min", "max"):
            raise CheckpointError(
                f"Checkpointer mode must be 'min' or 'max', got {mode!r}.",
                hint="set train.monitor_mode to 'min' for a loss or 'max' for an accuracy",
            )
        self._directory = Path(directory)
        try:
            self._directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"Could not create the checkpoint folder {self._directory}: {exc.strerror or exc}.",
                hint="choose a run dir on a writable disk",
            ) from exc
        self._lock = FolderLock(self._directory)
        self._closed = False
        self._keep_last = keep_last
        self._keep_best = keep_best
        self._monitor = monitor
        self._mode = mode
        self._best_value: float | None = None
        self._best_epoch: int | None = None
        self._best_step: int | None = None
        self._best_name: str | None = None
        self._pending: _Pending | None = None

    def close(self) -> None:
        """Releases the folder's lock; the Checkpointer cannot save afterwards.

        A pending asynchronous save is finished first; its failure is only logged here
        (close runs on the way out of errors too): call :meth:`wait` to have it raised.
        """
        try:
            self.wait()
        except BaseException as exc:
            logger.warning("the last checkpoint was not saved: %s", exc)
        self._closed = True
        self._lock.release()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def directory(self) -> Path:
        """The checkpoints folder."""
        return self._directory

    @property
    def best_value(self) -> float | None:
        """The best ``monitor`` value saved so far, or None."""
        return self._best_value

    @property
    def best_path(self) -> Path | None:
        """The checkpoint folder ``best.json`` names, if both exist, else None."""
        return read_pointer(self._directory, "best")

    @property
    def last_path(self) -> Path | None:
        """The checkpoint folder ``last.json`` names, if both exist, else None."""
        return read_pointer(self._directory, "last")

    def _tracks_best(self) -> bool:
        return self._keep_best and self._monitor is not None

    def _monitored_value(self, metrics: Mapping[str, Any]) -> float:
        assert self._monitor is not None
        if self._monitor not in metrics:
            present = ", ".join(sorted(map(str, metrics))) or "none"
            raise CheckpointError(
                f"Cannot pick the best checkpoint: the monitored metric {self._monitor!r} is "
                f"not among the metrics given to save() (keys present: {present}).",
                hint="set train.monitor to one of the keys present, or set "
                "checkpoint.keep_best to false",
            )
        raw = metrics[self._monitor]
        try:
            # float() of a CUDA tensor is a CPU-GPU sync; once per checkpoint is fine.
            return float(raw)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"The monitored metric {self._monitor!r} is {raw!r}, not a number.",
                hint="pass metrics as plain floats (or one-element tensors)",
            ) from exc

    def _is_better(self, value: float) -> bool:
        if math.isnan(value):
            return False
        if self._best_value is None:
            return True
        return value < self._best_value if self._mode == "min" else value > self._best_value

    def save(
        self,
        state: Mapping[str, Any],
        *,
        epoch: int,
        step: int,
        metrics: Mapping[str, Any] | None = None,
        write_first: Callable[[Path, str], Mapping[str, Any] | Callable[[], Mapping[str, Any]]]
        | None = None,
    ) -> Path:
        """Writes a checkpoint folder, points last.json (and best.json) at it, rotates.

        Args:
            state: What to save (tensors and plain data). A copy is written with this
                object's post-save state added under ``STATE_KEY``.
            epoch: The epoch number, recorded in the manifest.
            step: The optimizer step, used in the folder name.
            metrics: The metrics of this point; must hold ``monitor`` when best is kept.
                None (a save between validations, e.g. mid-epoch) makes this checkpoint no
                candidate for best.
            write_first: Called as ``write_first(temp_folder, final_name)`` before
                state.pt is written (every rank's weight shards, see
                :mod:`stoker.checkpoint.sharded`); what it returns is added to the state.
                If it returns a callable instead (the shards are still being written),
                the save finishes in a background thread: the callable waits for them and
                returns the entries, then state.pt, manifest and marker are written (a
                copy of ``state`` as it is now) and pointers and rotation follow. Training
                goes on meanwhile; :meth:`wait` (or the next save, or :meth:`close`)
                waits for it.

        Returns:
            The checkpoint folder written (or, deferred, that will be once finished).

        Raises:
            CheckpointError: The monitored metric is missing, the Checkpointer is closed, or
                writing failed; a failed save leaves every checkpoint and pointer file as it
                was and rotates nothing.
        """
        if self._closed:
            raise CheckpointError(
                f"This Checkpointer for {self._directory} is closed.",
                hint="create a new Checkpointer to save again",
            )
        self.wait()  # the previous save is a checkpoint (or an error) before this one starts
        for name, number in (("epoch", epoch), ("step", step)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise CheckpointError(
                    f"Checkpointer.save needs {name} as an integer >= 0, got {number!r}."
                )
        is_best = False
        value = math.nan
        if self._tracks_best() and metrics is not None:
            value = self._monitored_value(metrics)
            is_best = self._is_better(value)
        if STATE_KEY in state and not _is_checkpointer_state(state[STATE_KEY]):
            raise CheckpointError(
                f"The state given to Checkpointer.save uses the key {STATE_KEY!r}, which "
                "stoker reserves for the checkpointer's own state.",
                hint=f"rename that entry of the state to something other than {STATE_KEY!r}",
            )
        # Leftovers of saves that were killed: safe to remove, the lock says no one else writes.
        self._remove_leftovers()
        healthy, _ = scan_checkpoints(self._directory)
        name = checkpoint_name(step, set(os.listdir(self._directory)))
        sequence = max((info.sequence for info in healthy), default=0) + 1
        after = self.state_dict()
        if is_best:
            after.update(best_value=value, best_epoch=epoch, best_step=step, best_checkpoint=name)
        final = self._directory / name
        pointers = {"last": {"checkpoint": name, "epoch": epoch, "step": step}}
        if is_best:
            pointers["best"] = {"checkpoint": name, "epoch": epoch, "step": step}
        elif self._best_pointer_is_stale():
            # A save killed between its rename and best.json left the old best named there.
            pointers["best"] = {
                "checkpoint": self._best_name,
                "epoch": self._best_epoch,
                "step": self._best_step,
            }
        temp = self._directory / f"{TEMP_PREFIX}{name}-{secrets.token_hex(4)}"
        best = (value, epoch, step, name) if is_best else None
        files = {"sequence": sequence, "epoch": epoch, "step": step, "metrics": metrics or {}}
        try:
            os.mkdir(temp)
            extra = write_first(temp, name) if write_first is not None else {}
        except BaseException as exc:
            self._raise(temp, final, state, exc)
        if callable(extra):  # the shards are still being written: finish in the background
            state = {**copy.deepcopy(dict(state)), STATE_KEY: after}  # as it is now
            self._pending = _Pending(
                final, lambda: self._finish(temp, final, state, extra, files, pointers, best)
            )
            return final
        self._finish(temp, final, {**state, STATE_KEY: after}, extra, files, pointers, best)
        return final

    def _finish(
        self,
        temp: Path,
        final: Path,
        state: Mapping[str, Any],
        extra: Mapping[str, Any] | Callable[[], Mapping[str, Any]],
        files: dict[str, Any],
        pointers: Mapping[Pointer, dict[str, Any]],
        best: tuple[float, int, int, str] | None,
    ) -> None:
        """state.pt, manifest and marker into ``temp``, renamed to ``final``; then rotation.

        A callable ``extra`` waits for the shards being written and returns the entries.
        """
        try:
            extra = extra() if callable(extra) else extra
            write_checkpoint_files(temp, {**state, **extra}, **files)
            self._commit(temp, final, pointers)
        except BaseException as exc:
            self._raise(temp, final, state, exc)
        if best is not None:
            self._best_value, self._best_epoch, self._best_step, self._best_name = best
        self._rotate(keep=final)

    def _raise(self, temp: Path, final: Path, state: Mapping[str, Any], exc: BaseException):
        """Removes what a failed save wrote and raises its error, for people."""
        with contextlib.suppress(OSError):
            shutil.rmtree(temp)
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            raise exc
        if isinstance(exc, OSError):
            raise os_error(final, "checkpoint", exc, needed=state_bytes(state)) from exc
        raise CheckpointError(
            f"Could not write checkpoint {final}: {type(exc).__name__}: {exc}",
            hint=f"save only {_PLAIN_DATA}",
        ) from exc

    @property
    def pending(self) -> Path | None:
        """The checkpoint an asynchronous save is still writing, or None."""
        return self._pending.final if self._pending is not None else None

    def wait(self) -> Path | None:
        """Waits for the pending asynchronous save; returns its checkpoint (None: none).

        Raises:
            CheckpointError: It failed (a full disk…): nothing of it is left, no pointer
                moved, nothing rotated, as after a failed :meth:`save`.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.thread.join()
        if pending.error is not None:
            raise pending.error
        return pending.final

    def _best_pointer_is_stale(self) -> bool:
        if not self._tracks_best() or self._best_name is None:
            return False
        if not (self._directory / self._best_name).is_dir():
            return False
        try:
            current = read_pointer(self._directory, "best")
        except CheckpointError:
            return True
        return current is None or current.name != self._best_name

    def _commit(self, temp: Path, final: Path, pointers: Mapping[Pointer, dict[str, Any]]) -> None:
        """Renames ``temp`` to ``final`` and replaces the pointer files, all or nothing."""
        prepared: list[tuple[Path, Path]] = []
        backups: list[PointerBackup] = []
        moved = False
        replaced = 0
        try:
            for which, content in pointers.items():
                target = self._directory / POINTERS[which]
                staged = target.with_name(f"{TEMP_PREFIX}{target.stem}-{secrets.token_hex(4)}")
                prepared.append((staged, target))
                write_durable(staged, (json.dumps(content, indent=2) + "\n").encode())
            for _, target in prepared:
                backups.append(PointerBackup(target))
            os.rename(temp, final)
            moved = True
            for staged, target in prepared:
                os.replace(staged, target)
                replaced += 1
            # One fsync of the folder makes the rename and the replaced pointers durable.
            fsync_dir(self._directory)
        except BaseException:
            self._undo(temp, final if moved else None, prepared, backups[:replaced])
            raise
        finally:
            for backup in backups:
                with contextlib.suppress(OSError):
                    backup.discard()

    def _undo(
        self,
        temp: Path,
        final: Path | None,
        prepared: list[tuple[Path, Path]],
        backups: list[PointerBackup],
    ) -> None:
        try:
            for backup in backups:
                backup.restore()
            if final is not None:
                os.rename(final, temp)  # the caller removes temp
            for staged, _ in prepared:
                staged.unlink(missing_ok=True)
        except OSError as exc:
            # The original error is what the user needs; this one is only logged.
            logger.warning(
                "could not undo a failed checkpoint save in %s: %s", self._directory, exc
            )

    def _remove_leftovers(self) -> None:
        for path in self._directory.glob(f"{TEMP_PREFIX}*"):
            try:
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("could not remove the leftover %s: %s", path, exc)

    def _rotate(self, *, keep: Path) -> None:
        healthy, damaged = scan_checkpoints(self._directory)
        kept = {keep.name} | {info.path.name for info in healthy[: self._keep_last]}
        if self._tracks_best() and self._best_name is not None:
            kept.add(self._best_name)
        doomed = [info.path for info in healthy if info.path.name not in kept]
        for path, reason in damaged:
            logger.warning("removing damaged checkpoint %s: %s", path, reason)
            doomed.append(path)
        for path in doomed:
            try:
                remove_folder(path)
            except OSError as exc:
                # The new checkpoint is safe; an old one that will not go is worth a warning,
                # not a failed save.
                logger.warning("could not delete old checkpoint %s: %s", path, exc)
        best_pointer = self._directory / POINTERS["best"]
        with contextlib.suppress(OSError, CheckpointError):
            if best_pointer.exists() and read_pointer(self._directory, "best") is None:
                best_pointer.unlink()

    def state_dict(self) -> dict[str, Any]:
        """The best-so-far bookkeeping (value, epoch, step, folder name), as plain data."""
        return {
            "monitor": self._monitor,
            "mode": self._mode,
            "best_value": self._best_value,
            "best_epoch": self._best_epoch,
            "best_step": self._best_step,
            "best_checkpoint": self._best_name,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the best-so-far from :meth:`state_dict` (or a checkpoint's ``STATE_KEY``).

        The best checkpoint's folder is protected from rotation from then on. If the saved
        state tracked a different monitor or mode, its best value is not comparable: it is
        dropped with a warning and best tracking starts afresh.

        Raises:
            CheckpointError: ``state`` is not a checkpointer state.
        """
        if not _is_checkpointer_state(state):
            raise CheckpointError(
                f"Not a Checkpointer state: expected the keys {', '.join(_STATE_FIELDS)}, "
                f"got {', '.join(sorted(map(str, state))) or 'none'}.",
                hint="pass what Checkpointer.state_dict() returned, e.g. "
                f"checkpoint[{STATE_KEY!r}]",
            )
        if (state["monitor"], state["mode"]) != (self._monitor, self._mode):
            logger.warning(
                "checkpoint tracked the best by %s (%s), this run by %s (%s); "
                "starting best tracking afresh",
                state["monitor"],
                state["mode"],
                self._monitor,
                self._mode,
            )
            self._best_value = self._best_epoch = self._best_step = self._best_name = None
            return
        best = state["best_value"]
        self._best_value = None if best is None else float(best)
        self._best_epoch = state["best_epoch"]
        self._best_step = state["best_step"]
        # Older states have no folder name; a name that is not a checkpoint name is ignored,
        # so a crafted state cannot make rotation keep (or name) a path outside the folder.
        name = state.get("best_checkpoint")
        self._best_name = name if is_checkpoint_name(name) else None


class _Pending:
    """An asynchronous save, finishing in a thread of its own (:meth:`Checkpointer.wait`)."""

    def __init__(self, final: Path, finish: Callable[[], None]) -> None:
        self.final = final
        self.error: BaseException | None = None
        self.thread = threading.Thread(
            target=self._run, args=(finish,), name=f"stoker-save-{final.name}", daemon=True
        )
        self.thread.start()

    def _run(self, finish: Callable[[], None]) -> None:
        try:
            finish()
        except BaseException as exc:  # raised by wait(), in the thread that trains
            self.error = exc


def _is_checkpointer_state(value: object) -> bool:
    return isinstance(value, Mapping) and all(key in value for key in _STATE_FIELDS)
