"""The type checker: mypy, strict, over the public modules (pyproject's ``[tool.mypy]``).

It runs as a test, not as its own line in ``make test``: on one of the xdist workers it
overlaps the other tests instead of adding its wall time before them (cold, with no
``.mypy_cache``: about 30 s of CPU; warm: about 1 s).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_public_modules_pass_mypy_strict() -> None:
    # The files, the strictness and the pydantic plugin come from pyproject.toml; the
    # cache is the checkout's .mypy_cache (ignored by git), so a rerun checks only changes.
    done = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"mypy found type errors:\n{done.stdout}{done.stderr}"
