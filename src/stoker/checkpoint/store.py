"""The checkpoint folder of a run: epoch files, last.pt, best.pt, rotation and lookup."""

from __future__ import annotations

import logging
import math
import os
import re
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from stoker.checkpoint.io import atomic_path, save_atomic
from stoker.errors import CheckpointError

__all__ = ["STATE_KEY", "Checkpointer", "find_latest"]

logger = logging.getLogger(__name__)

LAST = "last.pt"
BEST = "best.pt"
# The key under which Checkpointer.save stores its own (post-save) state in each checkpoint.
STATE_KEY = "checkpointer"
_EPOCH_FILE_RE = re.compile(r"epoch-(\d+)-step-(\d+)\.pt")
_STATE_FIELDS = ("monitor", "mode", "best_value", "best_epoch", "best_step")


def _epoch_files(directory: Path) -> list[Path]:
    """The ``epoch-*-step-*.pt`` files in ``directory``, oldest (epoch, step) first."""
    found: list[tuple[tuple[int, int], Path]] = []
    for path in directory.glob("epoch-*.pt"):
        match = _EPOCH_FILE_RE.fullmatch(path.name)
        if match and path.is_file():
            found.append(((int(match[1]), int(match[2])), path))
    return [path for _, path in sorted(found)]


def find_latest(directory_or_run_dir: str | Path) -> Path | None:
    """Finds the checkpoint to resume from.

    Args:
        directory_or_run_dir: A checkpoints folder, or a run dir that holds ``checkpoints/``.

    Returns:
        ``last.pt`` if present, else the newest ``epoch-*.pt`` by (epoch, step), else None
        (also when the folder does not exist).
    """
    directory = Path(directory_or_run_dir)
    if (directory / "checkpoints").is_dir():
        directory = directory / "checkpoints"
    if not directory.is_dir():
        return None
    if (directory / LAST).is_file():
        return directory / LAST
    epoch_files = _epoch_files(directory)
    return epoch_files[-1] if epoch_files else None


def _point_at(target: Path, link: Path) -> None:
    """Makes ``link`` an atomic hard link to ``target`` (a copy where links are unsupported)."""
    tmp = link.with_name(f".tmp-{link.stem}-{secrets.token_hex(6)}{link.suffix}")
    try:
        os.link(target, tmp)
    except OSError:
        # Some filesystems (FAT, a few network mounts) have no hard links: copy instead.
        with atomic_path(link, what="checkpoint link") as copy_tmp:
            shutil.copyfile(target, copy_tmp)
        return
    try:
        os.replace(tmp, link)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(
            f"Could not point {link} at {target}: {exc.strerror or exc}.",
            hint=f"check that {link.parent} is writable",
        ) from exc
    # rename() is a no-op when both names already share an inode, leaving tmp behind.
    tmp.unlink(missing_ok=True)


class Checkpointer:
    """Owns a checkpoint folder: writes epoch files, keeps last.pt/best.pt, rotates old files.

    Files are ``epoch-{epoch:04d}-step-{step:08d}.pt``; ``last.pt`` and ``best.pt`` are hard
    links to one of them, so rotating an epoch file away never changes them. Only the newest
    ``keep_last`` epoch files (by epoch, then step) are kept, and the file just written always
    counts among them.

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
        """Creates the folder if it is missing.

        Args:
            directory: The checkpoint folder (usually ``<run dir>/checkpoints``).
            keep_last: How many epoch files to keep; at least 1.
            keep_best: Whether to keep ``best.pt``; needs ``monitor``.
            monitor: The metric key that decides the best checkpoint; None turns best off.
            mode: "min" if a lower ``monitor`` value is better, "max" if higher is better.

        Raises:
            CheckpointError: An option is invalid or the folder cannot be created.
        """
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise CheckpointError(
                f"checkpoint.keep_last must be an integer >= 1, got {keep_last!r}.",
                hint="set checkpoint.keep_last to 1 or more (last.pt needs one epoch file)",
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
        self._keep_last = keep_last
        self._keep_best = keep_best
        self._monitor = monitor
        self._mode = mode
        self._best_value: float | None = None
        self._best_epoch: int | None = None
        self._best_step: int | None = None

    @property
    def directory(self) -> Path:
        """The checkpoint folder."""
        return self._directory

    @property
    def best_value(self) -> float | None:
        """The best ``monitor`` value saved so far, or None."""
        return self._best_value

    @property
    def best_path(self) -> Path | None:
        """``best.pt`` if it exists, else None."""
        path = self._directory / BEST
        return path if path.is_file() else None

    @property
    def last_path(self) -> Path | None:
        """``last.pt`` if it exists, else None."""
        path = self._directory / LAST
        return path if path.is_file() else None

    def _tracks_best(self) -> bool:
        return self._keep_best and self._monitor is not None

    def _monitored_value(self, metrics: Mapping[str, float]) -> float:
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
        metrics: Mapping[str, float],
    ) -> Path:
        """Writes a checkpoint, updates last.pt (and best.pt if it is the best), rotates.

        Args:
            state: What to save (tensors and plain data). A copy is written with this
                object's post-save state added under ``STATE_KEY``.
            epoch: The epoch number, used in the file name.
            step: The optimizer step, used in the file name.
            metrics: The metrics of this point; must hold ``monitor`` when best is kept.

        Returns:
            The epoch file written.

        Raises:
            CheckpointError: The monitored metric is missing, or writing failed; a failed
                write leaves every existing file as it was and rotates nothing.
        """
        for name, number in (("epoch", epoch), ("step", step)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 0:
                raise CheckpointError(
                    f"Checkpointer.save needs {name} as an integer >= 0, got {number!r}."
                )
        is_best = False
        value = math.nan
        if self._tracks_best():
            value = self._monitored_value(metrics)
            is_best = self._is_better(value)
        if STATE_KEY in state and not _is_checkpointer_state(state[STATE_KEY]):
            raise CheckpointError(
                f"The state given to Checkpointer.save uses the key {STATE_KEY!r}, which "
                "stoker reserves for the checkpointer's own state.",
                hint=f"rename that entry of the state to something other than {STATE_KEY!r}",
            )
        after = self.state_dict()
        if is_best:
            after.update(best_value=value, best_epoch=epoch, best_step=step)
        path = self._directory / f"epoch-{epoch:04d}-step-{step:08d}.pt"
        save_atomic({**state, STATE_KEY: after}, path)
        _point_at(path, self._directory / LAST)
        if is_best:
            _point_at(path, self._directory / BEST)
            self._best_value, self._best_epoch, self._best_step = value, epoch, step
        self._rotate(keep=path)
        return path

    def _rotate(self, *, keep: Path) -> None:
        others = [p for p in _epoch_files(self._directory) if p != keep]
        stale = others[: max(0, len(others) - (self._keep_last - 1))]
        for path in stale:
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                # The new checkpoint is safe; an old file that will not go is worth a warning,
                # not a failed save.
                logger.warning("could not delete old checkpoint %s: %s", path, exc)

    def state_dict(self) -> dict[str, Any]:
        """The best-so-far bookkeeping, as plain data."""
        return {
            "monitor": self._monitor,
            "mode": self._mode,
            "best_value": self._best_value,
            "best_epoch": self._best_epoch,
            "best_step": self._best_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores the best-so-far from :meth:`state_dict` (or a checkpoint's ``STATE_KEY``).

        If the saved state tracked a different monitor or mode, its best value is not
        comparable: it is dropped with a warning and best tracking starts afresh.

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
            self._best_value = self._best_epoch = self._best_step = None
            return
        best = state["best_value"]
        self._best_value = None if best is None else float(best)
        self._best_epoch = state["best_epoch"]
        self._best_step = state["best_step"]


def _is_checkpointer_state(value: object) -> bool:
    return isinstance(value, Mapping) and all(key in value for key in _STATE_FIELDS)
