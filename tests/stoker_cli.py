"""`stoker ...` in the test's own process: the CLI without an interpreter's start-up.

A fresh ``python -m stoker`` spends ~4-5 s of CPU importing torch before it parses a
flag; the suite keeps at least one true subprocess test per subcommand (the user's
path) and runs the rest through :func:`run_cli`, which returns what a subprocess would:
the exit code, stdout, and stderr holding both the printed error and stoker's log lines
(formatted as the CLI's own ``logging.basicConfig`` formats them).

Everything the CLI sets for its process is given back afterwards: the loggers' levels
and handlers, the working directory, the environment, the global RNGs and the intra-op
thread count — so a run here cannot change what a later test sees.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

LOG_FORMAT = "stoker: %(levelname)s: %(message)s"


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Restore the process-wide state a test or a shared fixture may change."""
    torch_rng = torch.get_rng_state()
    numpy_rng = np.random.get_state()
    python_rng = random.getstate()
    threads = torch.get_num_threads()
    environ = dict(os.environ)
    cwd = os.getcwd()
    try:
        yield
    finally:
        torch.set_rng_state(torch_rng)
        np.random.set_state(numpy_rng)
        random.setstate(python_rng)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        if os.environ != environ:
            os.environ.clear()
            os.environ.update(environ)
        if os.getcwd() != cwd:
            os.chdir(cwd)


@contextlib.contextmanager
def _logging_kept(stream: io.StringIO) -> Iterator[None]:
    """Stoker's log lines into ``stream``, as the CLI's process would write them to stderr."""
    root, ours = logging.getLogger(), logging.getLogger("stoker")
    levels = root.level, ours.level
    root_handlers, our_handlers = list(root.handlers), list(ours.handlers)
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    ours.addHandler(handler)
    try:
        yield
    finally:
        root.handlers[:] = root_handlers
        ours.handlers[:] = our_handlers
        root.setLevel(levels[0])
        ours.setLevel(levels[1])


def run_cli(
    *args: str | Path, cwd: Path | None = None, threads: int | None = None
) -> subprocess.CompletedProcess[str]:
    """``stoker ARGS`` in this process; a CompletedProcess as ``subprocess.run`` returns.

    ``threads`` sets the intra-op thread count for the run (what ``OMP_NUM_THREADS``
    does for a subprocess). A ``SystemExit`` (argparse's usage errors) becomes the code.
    """
    from stoker.cli.main import main  # the CLI's modules only where a test runs it

    argv = [str(arg) for arg in args]
    out, err = io.StringIO(), io.StringIO()
    with process_state_kept(), _logging_kept(err):
        if cwd is not None:
            os.chdir(cwd)
        if threads is not None:
            torch.set_num_threads(threads)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
    return subprocess.CompletedProcess(["stoker", *argv], code, out.getvalue(), err.getvalue())
