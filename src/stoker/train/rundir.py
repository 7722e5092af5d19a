"""The run dir: where a run writes its config, metrics, event files and checkpoints."""

from __future__ import annotations

import re
import shlex
import time
from pathlib import Path

from stoker.errors import ConfigError


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
