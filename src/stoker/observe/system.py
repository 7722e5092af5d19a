"""System metrics per epoch: CPU use and memory of the process and its loader workers, GPU."""

from __future__ import annotations

import logging
import resource
import sys
import time
from typing import Any

import psutil
import torch

logger = logging.getLogger("stoker")


class SystemMonitor:
    """What the seeds' exercise 6 asks to watch while training: CPU, memory, GPU.

    ``sample()`` returns the figures since the previous call: CPU utilization of the
    training process and of its worker processes (100% = one core busy), current and
    peak RSS, and on CUDA the GPU's utilization (through NVML, when nvidia-ml-py is
    installed) and peak memory.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._process = psutil.Process()
        self._last_wall = time.perf_counter()
        self._last_cpu = self._process.cpu_times()
        self._last_children_cpu = self._children_cpu_s()
        self._warned_nvml = False

    def sample(self, *, num_workers: int) -> dict[str, Any]:
        """CPU, memory and worker figures since the last call, as fields of a metric record."""
        now = time.perf_counter()
        wall = max(now - self._last_wall, 1e-9)
        cpu = self._process.cpu_times()
        main_cpu = (cpu.user + cpu.system) - (self._last_cpu.user + self._last_cpu.system)
        self._last_wall, self._last_cpu = now, cpu
        record: dict[str, Any] = {
            "system/cpu_pct": 100.0 * main_cpu / wall,
            "system/workers_cpu_pct": self._workers_cpu_pct(wall, scan=num_workers > 0),
            "system/rss_mib": self._process.memory_info().rss / 2**20,
            "system/peak_rss_mib": peak_rss_mib(),
            "system/cpu_count": psutil.cpu_count() or 0,
            "loader/num_workers": num_workers,
        }
        if self.device.type == "cuda":
            record.update(self._gpu())
        return record

    def _workers_cpu_pct(self, wall: float, *, scan: bool) -> float:
        """CPU of child processes (DataLoader workers) over the last interval.

        Cumulative worker CPU = live children's CPU time + that of children already
        ended and reaped (which the OS adds to ours); its change per wall second
        counts every worker once, whether workers persist across epochs or not.
        Without workers the live children are not listed (``scan`` False): that walks
        every process of the machine, milliseconds at each epoch's end.
        """
        total = self._children_cpu_s(scan=scan)
        busy = total - self._last_children_cpu
        self._last_children_cpu = total
        return max(0.0, 100.0 * busy / wall)

    def _children_cpu_s(self, *, scan: bool = True) -> float:
        times = self._process.cpu_times()
        total = times.children_user + times.children_system
        if not scan:
            return total
        for child in self._process.children(recursive=True):
            try:
                child_times = child.cpu_times()
            except psutil.Error:
                continue  # ended between listing and reading
            total += child_times.user + child_times.system
        return total

    def _gpu(self) -> dict[str, Any]:
        index = self.device.index or 0
        record: dict[str, Any] = {
            "gpu/peak_memory_mib": torch.cuda.max_memory_allocated(index) / 2**20,
            "gpu/memory_reserved_mib": torch.cuda.memory_reserved(index) / 2**20,
        }
        try:
            record["gpu/utilization_pct"] = float(torch.cuda.utilization(index))
        except Exception as error:  # NVML missing or not permitted: say so once.
            if not self._warned_nvml:
                logger.warning(
                    "GPU utilization unavailable (%s); pip install nvidia-ml-py to record it",
                    error,
                )
                self._warned_nvml = True
        return record


def peak_rss_mib() -> float:
    """Peak resident memory of this process in MiB (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def environment() -> dict[str, Any]:
    """The software and hardware a run used, written to ``environment.json``."""
    import platform

    from stoker import __version__

    info: dict[str, Any] = {
        "stoker": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": psutil.cpu_count() or 0,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info
