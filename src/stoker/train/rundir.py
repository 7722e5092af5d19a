"""The run dir: where a run writes its config, metrics, event files and checkpoints.

Which files a run writes there, finding the run a ``--resume`` names and its newest
checkpoint, and the summary and closing lines a run leaves behind.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.checkpoint import find_latest_valid, is_checkpoint_dir, load_checkpoint
from stoker.errors import CheckpointError, ConfigError
from stoker.observe.verdict import run_summary
from stoker.safe_files import write_text

if TYPE_CHECKING:
    from stoker.config import RunConfig
    from stoker.distributed.runtime import Distributed
    from stoker.train.loop import Loop

logger = logging.getLogger("stoker")


def create_run_dir(run_dir: str | Path | None, *, root: str | Path, name: str) -> Path:
    """Create the run dir: ``run_dir`` if given, else ``<root>/<name>-<YYYYmmdd-HHMMSS>``.

    A folder that already holds a run (its ``config.yaml``) is refused: two runs
    writing one folder would mix their metrics and checkpoints.
    """
    if run_dir is not None:
        path = Path(run_dir)
    else:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "run"
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(root) / f"{slug}-{stamp}"
        suffix = 2
        while path.exists():
            path = Path(root) / f"{slug}-{stamp}-{suffix}"
            suffix += 1
    if (path / "config.yaml").exists():
        raise ConfigError(
            f"{path} already holds a run",
            hint=f"continue it with --resume {shlex.quote(str(path))}, or choose another --run-dir",
        )
    path.mkdir(parents=True, exist_ok=True)
    return path


def resume_command(template: str, run_dir: str | Path) -> str:
    """``template``'s ``{run_dir}`` filled in, shell-quoted: a command to paste as printed.

    A run dir with a space (or any character a shell reads) comes out quoted, so the
    printed ``stoker train ... --resume '<run dir>'`` works as it stands.
    """
    return template.format(run_dir=shlex.quote(str(run_dir)))


#: The files a run writes in its run dir (and bad_records.jsonl, named per rank).
RUN_FILES = (
    "config.yaml",
    "data_fingerprint.json",
    "metrics.jsonl",
    "environment.json",
    "summary.json",
    "report.html",
)


def per_rank(name: str, dist: Distributed) -> str:
    """``name`` for rank 0 (and a single process); ``stem.rankN.suffix`` for the others."""
    if dist.is_main:
        return name
    stem, _, suffix = name.rpartition(".")
    return f"{stem}.rank{dist.rank}.{suffix}"


def open_run_dir(config: RunConfig, resume: str | Path | None) -> Path:
    """The run dir being resumed (from a run dir or one of its checkpoints), or a new one."""
    if resume is not None:
        path = Path(resume)
        return path.parent.parent if path.is_file() or is_checkpoint_dir(path) else path
    return create_run_dir(config.tracking.run_dir, root=config.tracking.runs_root, name=config.name)


def load_resume_bundle(resume: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint of a run dir; None for a run stopped before its first one."""
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"--resume: {path} does not exist", hint="give the run dir to resume")
    checkpoint, damaged = find_latest_valid(path)
    for folder, reason in damaged:
        logger.warning("checkpoint %s is damaged (%s); skipping it", folder, reason)
    if checkpoint is None:
        if damaged:
            raise CheckpointError(
                f"--resume: every checkpoint in {path} is damaged; the newest: {damaged[0][1]}",
                hint="restore the checkpoints from a copy, or start a new run",
            )
        if (path / "config.yaml").is_file():
            return None  # killed before its first checkpoint: start it again from the top
        raise CheckpointError(
            f"--resume: {path} is not a run dir (no config.yaml, no checkpoints)",
            hint="give the folder a run printed as its run dir",
        )
    if damaged:
        logger.warning("resuming from %s, the newest checkpoint that verifies", checkpoint)
    return load_checkpoint(checkpoint, verify=False)  # find_latest_valid just verified it


def write_summary(loop: Loop, run_dir: Path) -> dict[str, Any]:
    """The run's verdict, phase table and epochs, to ``summary.json`` (the report shows it).

    ``training`` holds the epochs as the loop counted them (from 1, as in the records),
    so the report names the best epoch the monitor chose (``min_delta`` and all) and
    whether early stopping ended the run, rather than working them out again.
    """
    stats = loop.timer.summary(whole_run=True)
    samples_per_s = 0.0
    if stats:
        samples_per_s = loop.state.samples_seen / max(stats["step"].total_s, 1e-12)
    summary = run_summary(
        stats,
        num_workers=getattr(loop.train_loader.dataloader, "num_workers", 0),
        device_type=loop.device.type,
        samples_per_s=samples_per_s,
    )
    state, monitor = loop.state, loop.monitor
    summary["training"] = {
        "epochs_done": state.epoch,  # a count of finished epochs: the last one's number
        "epochs": loop.epochs,
        "stopped_early": loop.stopped_early,
        "monitor": monitor.metric,
        "mode": monitor.mode,
        "best_value": state.best_value,
        "best_epoch": state.best_epoch,
    }
    if skipped := loop.train_loader.bad_records.total:  # distinct records, train and val
        summary["data"] = {"bad_records": skipped}
    write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def say_where(view: Any, run_dir: Path, resume_hint: str | None) -> None:
    """The closing lines: where the run is, how to resume it, view it and read its report."""
    view.message(f"run dir: {run_dir}")
    if resume_hint:
        view.message(f"resume:  {resume_command(resume_hint, run_dir)}")
    if (run_dir / "tb").is_dir():
        view.message(f"view:    tensorboard --logdir {shlex.quote(str(run_dir / 'tb'))}")
    view.message(f"report:  {run_dir / 'report.html'}")
