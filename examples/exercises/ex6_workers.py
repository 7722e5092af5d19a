"""Exercise 6 — DataLoader workers: num_workers = 0, 2, 4, measured, not assumed.

Each setting trains the same small model for one epoch with ``stoker.fit`` and reads
what stoker measures on every run: the time the training loop waited for batches
(``time/data_wait_s``; per batch = divided by the number of steps), the epoch time,
CPU use of the training process and of its workers (``system/cpu_pct``,
``system/workers_cpu_pct``; 100% = one core) and, on CUDA, GPU utilization.

The samples cost CPU work to "decode" (a chain of tensor operations), as images or
text would. Workers start processes and pass batches between them: on a machine with
few or busy cores, more workers can be slower. The fastest setting is the one measured
fastest here; ``stoker tune CONFIG`` runs this search (and more) for a run config.

Run: python examples/exercises/ex6_workers.py
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import stoker


class DecodedSamples(Dataset):
    """Samples that cost ``ops`` tensor operations each, like decoding an image."""

    def __init__(self, n: int = 2048, ops: int = 40, size: int = 256) -> None:
        generator = torch.Generator().manual_seed(0)
        self.raw = torch.randn(n, size, generator=generator)
        self.labels = (self.raw[:, 0] > 0).long()
        self.ops = ops

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.raw[index]
        for _ in range(self.ops):  # the per-sample CPU work a worker can take over
            x = torch.tanh(x * 1.01)
        return x, self.labels[index]


def main(
    workers: tuple[int, ...] = (0, 2, 4),
    samples: int = 2048,
    ops: int = 40,
    batch_size: int = 64,
    runs_root: str | Path = "runs",
) -> dict[str, dict[str, float]]:
    """Returns, per worker count, the figures stoker measured for the epoch."""
    dataset = DecodedSamples(samples, ops)
    steps = math.ceil(samples / batch_size)
    figures: dict[str, dict[str, float]] = {}
    print(f"{samples} samples, {ops} ops each, batch {batch_size}, {steps} batches per epoch")
    header = f"{'workers':>7} {'wait/batch ms':>13} {'epoch s':>8} {'main CPU %':>10}"
    print(header + f" {'workers CPU %':>13} {'GPU util %':>10}")
    for num_workers in workers:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 2))
        result = stoker.fit(
            model,
            dataset,
            epochs=1,
            batch_size=batch_size,
            num_workers=num_workers,
            lr=1e-3,
            enabled=False,  # no checkpoints: only the timing matters here
            runs_root=str(runs_root),
            name=f"ex6-workers{num_workers}",
            progress="quiet",
        )
        m = result.metrics
        gpu = m.get("gpu/utilization_pct")
        row = {
            "batch_wait_ms": 1e3 * m["time/data_wait_s"] / steps,
            "epoch_s": m["time/epoch_s"],
            "cpu_pct": m["system/cpu_pct"],
            "workers_cpu_pct": m["system/workers_cpu_pct"],
            "gpu_utilization_pct": float("nan") if gpu is None else gpu,
        }
        figures[str(num_workers)] = row
        gpu_text = "n/a" if gpu is None else f"{gpu:.0f}"
        print(
            f"{num_workers:>7} {row['batch_wait_ms']:>13.2f} {row['epoch_s']:>8.2f} "
            f"{row['cpu_pct']:>10.0f} {row['workers_cpu_pct']:>13.0f} {gpu_text:>10}"
        )
    best = min(figures, key=lambda w: figures[w]["epoch_s"])
    print(f"fastest here: num_workers={best} (on {os.cpu_count()} CPU cores)")
    return figures


if __name__ == "__main__":
    main()
