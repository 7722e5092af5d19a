"""Datasets that fail on purpose inside loader workers, for tests/faults/test_loader_faults.py.

Each records the pid of every process that reads it (a file per pid in ``pid_dir``), so a
test can check that no worker outlives the error. ``faulty`` and ``tiny_model`` are named
in a run config as ``loader_datasets.py:faulty`` for the end-to-end CLI test.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, get_worker_info

SAMPLES = 64
FEATURES = 4


class Faulty(Dataset):
    """Samples ``(features, label)``; reading sample ``at`` does ``fault``.

    Faults: ``kill`` (SIGKILL, as the out-of-memory killer does), ``bus`` (SIGBUS, as a
    write to a full /dev/shm does), ``exit`` (``os._exit(3)``), ``hang`` (sleeps an hour),
    ``raise`` (ValueError), ``unpicklable`` (returns a lock in place of the label).
    """

    def __init__(
        self, fault: str, *, at: int = 13, pid_dir: str | None = None, in_workers_only: bool = False
    ) -> None:
        self.fault = fault
        self.at = at
        self.pid_dir = pid_dir
        # A run reads samples in the training process too (checks, fingerprint): spare it.
        self.in_workers_only = in_workers_only
        self.path = "records/train.bin"  # what a file-backed source would name
        self.x = torch.arange(SAMPLES * FEATURES, dtype=torch.float32).view(SAMPLES, FEATURES)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, Any]:
        if self.pid_dir is not None:
            Path(self.pid_dir, str(os.getpid())).touch()
        if index == self.at and (get_worker_info() or not self.in_workers_only):
            return self._fail()
        return self.x[index], torch.tensor(index % 2)

    def _fail(self) -> tuple[torch.Tensor, Any]:
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "bus":
            os.kill(os.getpid(), signal.SIGBUS)
        elif self.fault == "exit":
            os._exit(3)
        elif self.fault == "hang":
            time.sleep(3600)
        elif self.fault == "raise":
            raise ValueError(f"record {self.at} is corrupt")
        elif self.fault == "unpicklable":
            return self.x[self.at], threading.Lock()
        return self.x[self.at], torch.tensor(0)


class FaultyBatches(Faulty):
    """Like :class:`Faulty`, but fetched a whole batch at a time (``__getitems__``)."""

    returns_batches = True

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, Any]:
        if self.pid_dir is not None:
            Path(self.pid_dir, str(os.getpid())).touch()
        if self.at in indices:
            if self.fault == "unpicklable":
                return self.x[indices], threading.Lock()
            self._fail()
        return self.x[indices], torch.tensor(indices) % 2


class RaisingCollate:
    """A collate function that raises ``message`` as PyTorch's shared-memory code does."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __call__(self, samples: list[Any]) -> Any:
        raise RuntimeError(self.message)


def faulty(fault: str = "kill", at: int = 13) -> Faulty:
    return Faulty(fault, at=at, in_workers_only=True)


def tiny_model() -> nn.Module:
    return nn.Linear(FEATURES, 2)
