"""Datasets and models of the doctor's four cases, named in YAML configs as `module:callable`.

Each case makes one stage the bottleneck on a small CPU machine:

1. ``slow_samples`` + ``small_mlp``: every ``__getitem__`` sleeps 2 ms (a slow disk or
   decoder) -> input-bound.
2. ``cheap_samples`` + ``linear``: a per-sample Dataset whose samples cost microseconds,
   feeding a single Linear layer -> loader-overhead (per-sample fetch + collate dominate).
3. ``array_samples`` + ``wide_mlp``: in-memory ArrayDataset (batched fetch) and big
   matmuls -> compute-bound.
4. ``busy_samples`` + ``small_mlp`` with 8 workers on 2 cores: each sample burns CPU,
   and more workers than cores cannot make more CPU -> oversubscribed.
"""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset

from stoker.data.sources import ArrayDataset


def _features(n: int, features: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = (x[:, 0] > 0).long() % classes
    return x, y


class SlowSamples(Dataset):
    """Each sample waits ``delay_s`` (I/O-like: the CPU is idle while it waits)."""

    def __init__(self, n: int = 2048, features: int = 16, delay_s: float = 0.002) -> None:
        self.x, self.y = _features(n, features, 2, seed=1)
        self.delay_s = delay_s

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.delay_s)
        return self.x[index], self.y[index]


class CheapSamples(Dataset):
    """Normalized rows of an in-memory tensor, one at a time: a few µs each, no __getitems__."""

    def __init__(self, n: int = 8192, features: int = 8) -> None:
        self.x, self.y = _features(n, features, 2, seed=2)
        self.mean, self.std = self.x.mean(0), self.x.std(0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.x[index] - self.mean) / self.std, self.y[index]


class BusySamples(Dataset):
    """Each sample burns CPU in pure Python (one core per process, no threads)."""

    def __init__(self, n: int = 4096, features: int = 16, work: int = 6000) -> None:
        self.x, self.y = _features(n, features, 2, seed=3)
        self.work = work

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        acc = index
        for k in range(self.work):
            acc = (acc * 31 + k) % 1_000_003
        return self.x[index] + (acc % 2) * 0.0, self.y[index]


def slow_samples(n: int = 2048, features: int = 16, delay_s: float = 0.002) -> Dataset:
    return SlowSamples(n, features, delay_s)


def cheap_samples(n: int = 8192, features: int = 8) -> Dataset:
    return CheapSamples(n, features)


def busy_samples(n: int = 4096, features: int = 16, work: int = 6000) -> Dataset:
    return BusySamples(n, features, work)


def array_samples(n: int = 4096, features: int = 512) -> Dataset:
    x, y = _features(n, features, 2, seed=4)
    return ArrayDataset(x, y)


def linear(in_features: int = 8, out_features: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features)


def small_mlp(in_features: int = 16, out_features: int = 2, hidden: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, out_features))


def wide_mlp(in_features: int = 512, out_features: int = 2, hidden: int = 2048) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(in_features, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, hidden),
        nn.ReLU(),
        nn.Linear(hidden, out_features),
    )


#: The four cases: (dataset factory, model factory, extra loader settings, expected verdict).
CASES: dict[str, tuple[str, str, dict, str]] = {
    "slow_getitem": ("slow_samples", "small_mlp", {}, "input-bound"),
    "tiny_model_per_sample": ("cheap_samples", "linear", {}, "loader-overhead"),
    "heavy_model": ("array_samples", "wide_mlp", {}, "compute-bound"),
    "too_many_workers": ("busy_samples", "small_mlp", {"num_workers": 8}, "oversubscribed"),
}


def case_config(case: str, module: str = "doctor_cases.py") -> dict:
    """The YAML mapping of a case's run config; ``module`` is this file's path or module name."""
    dataset, model, loader, _ = CASES[case]
    return {
        "name": case,
        "seed": 0,
        "model": {"name": f"{module}:{model}"},
        "data": {"train": {"name": f"{module}:{dataset}"}},
        "loader": {"batch_size": 64, **loader},
        "loss": {"name": "cross_entropy"},
        "optim": {"name": "adamw", "lr": 0.001},
        "train": {"epochs": 1, "device": "cpu"},
    }
