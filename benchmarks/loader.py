"""Loader throughput on the seed workload: stoker vs the per-sample DataLoader vs a raw gather.

The data is the seed module's: 10,000 rows × 20 float32 features and an int64 label,
in memory. Contenders, each delivering shuffled epochs of (features, label) batches:

- ``gather``: the ceiling for in-memory data — a ``randperm`` split into batches and
  one ``index_select`` per field, in a bare Python loop;
- ``stoker``: ``stoker.build_loader(ArrayDataset(...), shuffle=True, num_workers=w)``;
- ``per-sample``: ``torch.utils.data.DataLoader(CSVWindowDataset(), shuffle=True,
  num_workers=w)``, the seed's per-sample Dataset and PyTorch's default collate.

Timed: whole epochs, iterating the loader and touching nothing but the batch (no
model), at batch 64 and 1024 and 0 and 2 workers. With workers each epoch starts its
workers, as the seed's loader does (``persistent_workers`` off); ``stoker w=2
persistent`` (no target) shows what started workers deliver. stoker serves in-memory
arrays in-process whatever ``num_workers`` says (``loader.note`` says so; the table's
note shows it): its ``w=2`` rows measure that decision. Each contender repeats epochs
until a call lasts ``MIN_CALL_S``. The contenders run interleaved, round by round, after
a warm-up round; figures are medians, ratios are medians of per-round ratios.

    python benchmarks/loader.py --out bench-out
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    CSVWindowDataset,
    Result,
    add_common_arguments,
    info,
    interleaved,
    median,
    paired_ratio,
    set_threads,
    spread,
    table,
    target_check,
)

from stoker import build_loader
from stoker.examples.datasets import seed_tabular

BATCH_SIZES = (64, 1024)
WORKERS = (0, 2)
MIN_CALL_S = 0.05  # contenders repeat epochs until a call lasts this long
CEILING_RATIO = 0.8
PER_SAMPLE_RATIO = 5.0


def epoch_counter(loader) -> Callable[[], int]:
    def run() -> int:
        samples = 0
        for batch in loader:
            samples += batch[0].shape[0]
        return samples

    return run


def gather_epoch(
    features: torch.Tensor, labels: torch.Tensor, batch_size: int
) -> Callable[[], int]:
    generator = torch.Generator().manual_seed(0)

    def run() -> int:
        samples = 0
        for idx in torch.randperm(len(features), generator=generator).split(batch_size):
            x = features.index_select(0, idx)
            labels.index_select(0, idx)
            samples += x.shape[0]
        return samples

    return run


def rate(epoch: Callable[[], int], epochs: int) -> Callable[[], float]:
    """A contender: ``epochs`` epochs per call, returning samples per second."""

    def run() -> float:
        started = time.perf_counter()
        samples = sum(epoch() for _ in range(epochs))
        return samples / (time.perf_counter() - started)

    return run


def epochs_for(epoch: Callable[[], int]) -> int:
    """Epochs per call so that one call lasts at least MIN_CALL_S (one warm epoch timed)."""
    epoch()
    started = time.perf_counter()
    epoch()
    once = time.perf_counter() - started
    return max(1, int(MIN_CALL_S / max(once, 1e-6)) + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    rounds = args.rounds or 7

    arrays = seed_tabular()
    features, labels = arrays.arrays
    per_sample = CSVWindowDataset()
    assert torch.equal(torch.from_numpy(per_sample.X), features), "seed data differs"

    checks = []
    figures: dict[str, dict] = {}
    notes: dict[str, str] = {}
    for batch_size in BATCH_SIZES:
        epochs: dict[str, Callable[[], int]] = {
            "gather": gather_epoch(features, labels, batch_size)
        }
        for workers in WORKERS:
            loader = build_loader(arrays, batch_size=batch_size, shuffle=True, num_workers=workers)
            if loader.note:
                notes[f"stoker w={workers}"] = "served in-process (loader.note)"
            epochs[f"stoker w={workers}"] = epoch_counter(loader)
            epochs[f"per-sample w={workers}"] = epoch_counter(
                DataLoader(per_sample, batch_size=batch_size, shuffle=True, num_workers=workers)
            )
        # Workers kept alive: after the warm-up round, what they deliver once started.
        epochs["stoker w=2 persistent"] = epoch_counter(
            build_loader(
                arrays,
                batch_size=batch_size,
                shuffle=True,
                num_workers=2,
                persistent_workers=True,
            )
        )
        # Measured, not assumed: a w=2 loader that starts workers runs one epoch per call.
        contenders = {name: rate(epoch, epochs_for(epoch)) for name, epoch in epochs.items()}
        print(f"batch {batch_size}: {rounds} rounds of {', '.join(contenders)}", flush=True)
        rates = interleaved(contenders, rounds=rounds)
        del contenders, epochs, loader  # the persistent workers end with their loader
        figures[f"batch_{batch_size}"] = {name: spread(values) for name, values in rates.items()}
        bench = "loader"
        for name, values in rates.items():
            checks.append(
                info(
                    bench,
                    f"b{batch_size} {name} throughput",
                    median(values),
                    unit="samples/s",
                    note=notes.get(name.removesuffix(" persistent"), ""),
                )
            )
        for workers in WORKERS:
            mine = rates[f"stoker w={workers}"]
            checks.append(
                target_check(
                    bench,
                    f"b{batch_size} w={workers} stoker / gather ceiling",
                    paired_ratio(mine, rates["gather"]),
                    ">=",
                    CEILING_RATIO,
                )
            )
            checks.append(
                target_check(
                    bench,
                    f"b{batch_size} w={workers} stoker / per-sample DataLoader",
                    paired_ratio(mine, rates[f"per-sample w={workers}"]),
                    ">=",
                    PER_SAMPLE_RATIO,
                )
            )
        checks.append(
            info(
                bench,
                f"b{batch_size} per-sample w=0 / w=2 (workers' slowdown)",
                paired_ratio(rates["per-sample w=0"], rates["per-sample w=2"]),
                unit="x",
            )
        )

    print(table(checks))
    result = Result(
        benchmark="loader",
        timed="whole shuffled epochs of the loader alone (no model), samples per second; "
        "with workers each epoch includes starting them (persistent_workers off)",
        workload={
            "rows": len(arrays),
            "features": features.shape[1],
            "batch_sizes": list(BATCH_SIZES),
            "workers": list(WORKERS),
            "rounds": rounds,
            "threads": args.threads,
        },
        figures=figures,
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
