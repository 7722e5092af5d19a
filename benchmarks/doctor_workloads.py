"""Datasets, models and collates of the doctor's scenarios (benchmarks/doctor_scenarios.py),
named in its YAML configs as ``path/to/doctor_workloads.py:callable``.

Where a scenario's bottleneck can be made of waiting (``time.sleep``), it is: a sleep
costs the same on an idle and on a busy machine, so the scenario's best setting does not
move with other load. CPU-bound ones (decode, collate, optimizer, threads) burn real CPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from stoker.data.sources import ArrayDataset


def _features(n: int, features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    return x, (x[:, 0] > 0).long()


class Sleepy(Dataset):
    """Each sample waits ``delay_s`` (a disk or network read: the CPU is idle)."""

    def __init__(self, n: int, features: int, delay_s: float) -> None:
        self.x, self.y = _features(n, features, 1)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.x[index], self.y[index]


class Busy(Dataset):
    """Each sample burns CPU in pure Python (a decoder; one core per process)."""

    def __init__(self, n: int, features: int, work: int) -> None:
        self.x, self.y = _features(n, features, 3)
        self.work = work

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        acc = index
        for k in range(self.work):
            acc = (acc * 31 + k) % 1_000_003
        return self.x[index] + (acc % 2) * 0.0, self.y[index]


class Cheap(Dataset):
    """Normalized rows of an in-memory tensor, one at a time (a few µs each)."""

    def __init__(self, n: int, features: int) -> None:
        self.x, self.y = _features(n, features, 2)
        self.mean, self.std = self.x.mean(0), self.x.std(0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.x[index] - self.mean) / self.std, self.y[index]


class CheapBatched(Cheap):
    """:class:`Cheap` with ``__getitems__``: the code change the doctor advises for it."""

    returns_batches = True

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        return (self.x[index] - self.mean) / self.std, self.y[index]


def sleepy(n: int = 1024, features: int = 16, delay_s: float = 0.002) -> Dataset:
    return Sleepy(n, features, delay_s)


def busy(n: int = 1024, features: int = 16, work: int = 3000) -> Dataset:
    return Busy(n, features, work)


def cheap(n: int = 8192, features: int = 8) -> Dataset:
    return Cheap(n, features)


def cheap_batched(n: int = 8192, features: int = 8) -> Dataset:
    return CheapBatched(n, features)


def arrays(n: int = 2048, features: int = 256) -> Dataset:
    x, y = _features(n, features, 4)
    return ArrayDataset(x, y)


def slow_collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """default_collate after a per-sample Python loop (a tokenizer-like cost, ~100 µs)."""
    for _ in samples:
        acc = 0
        for k in range(1500):
            acc = (acc * 31 + k) % 1_000_003
    return default_collate(samples)


def fast_collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """What the slow collate computes, vectorised: the code change the doctor advises."""
    return default_collate(samples)


# --- models ------------------------------------------------------------------------------


def linear(in_features: int = 8, out_features: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features)


def mlp(
    in_features: int = 16, hidden: int = 32, out_features: int = 2, depth: int = 1
) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(in_features, hidden), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, out_features))


class SleepyModel(nn.Module):
    """A Linear layer whose forward also waits ``delay_s`` (a steady compute cost)."""

    def __init__(self, in_features: int, delay_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, 2)
        self.delay_s = delay_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)
        return self.linear(x)


def sleepy_model(in_features: int = 16, delay_s: float = 0.02) -> nn.Module:
    torch.manual_seed(0)
    return SleepyModel(in_features, delay_s)


class ManySmall(nn.Module):
    """A Linear layer plus hundreds of tiny parameter tensors (per-tensor optimizer cost)."""

    def __init__(self, in_features: int, tensors: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, 2)
        self.bank = nn.Parameter(torch.zeros(tensors, 2))
        self.small = nn.ParameterList(nn.Parameter(torch.zeros(2)) for _ in range(tensors))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One cheap op over all the small tensors: forward and backward stay light, while
        # a non-fused optimizer updates each tensor on its own.
        bias = torch.stack(tuple(self.small)).sum(0) + self.bank.sum(0)
        return self.linear(x) + bias


def many_small(in_features: int = 16, tensors: int = 400) -> nn.Module:
    torch.manual_seed(0)
    return ManySmall(in_features, tensors)


def write_parquet(path: Path, *, rows: int = 4096, features: int = 16, row_group: int = 16) -> Path:
    """A Parquet table with tiny row groups (every random read decodes a whole group)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    x, y = _features(rows, features, 5)
    columns = {f"f{i}": x[:, i].numpy() for i in range(features)}
    columns["label"] = y.numpy()
    pq.write_table(pa.table(columns), path, row_group_size=row_group)
    return path
