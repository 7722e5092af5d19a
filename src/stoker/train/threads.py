"""PyTorch's intra-op thread count for a run, chosen from the cores the run can really use.

PyTorch starts one intra-op thread per core of the machine. A small model's kernels are
too short to gain from a second thread, and every parallel region ends at a barrier: on
a machine whose cores other processes keep busy, a thread that is waiting for a core
holds up every kernel. On a shared 2-core machine the seed MLP's step measured up to
~180× slower with PyTorch's two threads than with one. So ``train.threads: auto``
(the default) counts the cores this process may run on (``os.sched_getaffinity``, and a
cgroup CPU quota where there is one), takes away one per loader worker (they have a
core each) and the cores other processes kept busy over a short sample at the start
(``psutil.cpu_percent``), and keeps at least one. ``OMP_NUM_THREADS`` set in the
environment is respected as it is. An integer sets the count outright.

The choice is written to ``environment.json`` with its reason, and the count that was
there before is put back when the run ends (``stoker.fit`` leaves the process as it was).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
import torch

logger = logging.getLogger("stoker")

ThreadsSetting = int | Literal["auto"]
#: How long the start of a run watches the other processes' CPU use.
_SAMPLE_S = 0.1


@dataclass(frozen=True)
class Threads:
    """The thread count a run uses, why, and the count it replaced."""

    count: int
    reason: str
    previous: int

    def restore(self) -> None:
        """Put back the count the process had before the run."""
        torch.set_num_threads(self.previous)

    def record(self) -> dict[str, Any]:
        """What ``environment.json`` records."""
        return {"torch_threads": self.count, "torch_threads_reason": self.reason}


def use_threads(setting: ThreadsSetting, *, num_workers: int) -> Threads:
    """Set ``torch.set_num_threads`` for a run (``train.threads``); see the module docstring."""
    previous = torch.get_num_threads()
    count, reason = choose_threads(setting, num_workers=num_workers)
    torch.set_num_threads(count)
    # Recorded in environment.json; a line on stderr would read as part of an error.
    logger.debug("torch threads: %d (%s)", count, reason)
    return Threads(count, reason, previous)


def loader_workers(loader: Any) -> int:
    """How many worker processes a stoker loader (or a plain DataLoader) starts."""
    dataloader = getattr(loader, "dataloader", loader)
    return int(getattr(dataloader, "num_workers", 0) or 0)


def choose_threads(
    setting: ThreadsSetting,
    *,
    num_workers: int,
    cores: int | None = None,
    busy_elsewhere: float | None = None,
) -> tuple[int, str]:
    """``(threads, why)`` for ``train.threads``; ``cores`` and ``busy_elsewhere`` (cores
    other processes keep busy) are measured when not given."""
    if setting != "auto":
        return int(setting), f"train.threads={setting}"
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads(), "OMP_NUM_THREADS is set"
    usable = cores if cores is not None else usable_cores()
    busy = busy_elsewhere if busy_elsewhere is not None else busy_cores(usable)
    taken = round(busy)
    count = max(1, usable - num_workers - taken)
    return count, (
        f"auto: {usable} usable cores - {num_workers} loader workers - {taken} busy with "
        "other processes"
    )


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by a cgroup CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, quota) if quota is not None else cores)


def busy_cores(usable: int) -> float:
    """How many of this process's cores other processes kept busy over a short sample.

    The run is starting and idle while it sleeps through the sample, so the CPU time
    measured there is other processes'.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:
        allowed = None
    percents = psutil.cpu_percent(interval=_SAMPLE_S, percpu=True)
    if allowed is not None and max(allowed) < len(percents):
        percents = [percents[cpu] for cpu in allowed]
    busy = sum(percents) / 100
    return min(busy, float(usable))


def _cgroup_quota() -> int | None:
    """A cgroup v2 CPU quota in whole cores (rounded up), or None when unlimited."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except OSError:
        return None
    if len(text) != 2 or text[0] == "max":
        return None
    try:
        return max(1, math.ceil(int(text[0]) / int(text[1])))
    except (ValueError, ZeroDivisionError):
        return None
