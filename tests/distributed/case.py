"""Components for the distributed tests, loaded by the configs as `case.py:NAME`.

Faults are chosen by environment variables, so one config serves every test:
  CASE_KILL_AT_SAMPLE=N    rank CASE_RANK SIGKILLs itself after fetching N samples
                           (only in torchrun's first attempt unless CASE_KILL_ALWAYS=1)
  CASE_HANG_AT_SAMPLE=N    rank CASE_RANK sleeps for ever after fetching N samples
  CASE_SAMPLE_DELAY_S=S    every rank sleeps S seconds per sample (a run long enough to stop)
"""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.utils.data import Dataset, IterableDataset


def _features() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(320, 8, generator=generator)
    labels = (features[:, 0] - features[:, 1] + 0.5 * features[:, 2] > 0).long()
    return features, labels


class Samples(Dataset):
    """320 samples of 8 features and a binary label, fetched one by one."""

    def __init__(self) -> None:
        self.features, self.labels = _features()
        self.fetched = 0
        self.rank = int(os.environ.get("RANK", "0"))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched += 1
        self._maybe_fail()
        time.sleep(float(os.environ.get("CASE_SAMPLE_DELAY_S", "0")))
        return self.features[index], self.labels[index]

    def _maybe_fail(self) -> None:
        if int(os.environ.get("CASE_RANK", "-1")) != self.rank:
            return
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        kill_at = int(os.environ.get("CASE_KILL_AT_SAMPLE", "0"))
        if (
            kill_at
            and self.fetched == kill_at
            and (first_attempt or os.environ.get("CASE_KILL_ALWAYS"))
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        hang_at = int(os.environ.get("CASE_HANG_AT_SAMPLE", "0"))
        if hang_at and self.fetched == hang_at:
            while True:
                time.sleep(3600)


def samples() -> Dataset:
    return Samples()


def rank_sliced() -> Dataset:
    """Data a user split by rank already: each rank holds only its half."""
    data = Samples()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    keep = torch.arange(rank, len(data), world)
    data.features, data.labels = data.features[keep], data.labels[keep]
    return data


class UnevenStream(IterableDataset):
    """A stream that does not split itself evenly: rank r yields 64 + 32 r samples."""

    def __iter__(self):
        features, labels = _features()
        count = 64 + 32 * int(os.environ.get("RANK", "0"))
        for index in range(count):
            yield features[index], labels[index]


def uneven_stream() -> IterableDataset:
    return UnevenStream()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
