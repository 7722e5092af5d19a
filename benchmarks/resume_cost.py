"""What a mid-epoch resume costs: resuming at 90% of an epoch over a ~1 GB file, against the epoch.

Writes ``.npy`` files of about ``--size-gb`` in a temporary folder, reads one shuffled
epoch of them through ``stoker.data.build_loader`` (timing the whole epoch and the
point 90% of the way through it), then builds a fresh loader as a resumed run does,
restores the position at 90% and times how long it takes to hand out its first batch:
the resume's own cost. A loader that fetched and discarded the batches before the
position (what a replay does) would pay about the 90% mark's time instead; that figure
is shown beside it. The resumed batches are checked equal to the uninterrupted ones.

    python benchmarks/resume_cost.py --out bench-out                 # ~1 GB, a few minutes
    python benchmarks/resume_cost.py --out /tmp/rc --size-gb 0.05    # a quick run
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, add_common_arguments, info, set_threads, table, target_check

from stoker.data import build_loader
from stoker.data.memmap import NpyDataset

FEATURES = 64  # float32: 256 bytes a row, with an 8-byte label
BATCH = 1024
AT = 0.9  # resume at this fraction of the epoch
TARGET = 0.05  # resume cost / epoch time
WORKERS = (0, 2)


def write_npy(folder: Path, rows: int) -> None:
    """features.npy and label.npy, written a chunk at a time (bounded memory)."""
    rng = np.random.default_rng(0)
    features = np.lib.format.open_memmap(
        folder / "features.npy", "w+", dtype=np.float32, shape=(rows, FEATURES)
    )
    labels = np.lib.format.open_memmap(folder / "label.npy", "w+", dtype=np.int64, shape=(rows,))
    for start in range(0, rows, 1 << 18):
        stop = min(rows, start + (1 << 18))
        features[start:stop] = rng.standard_normal((stop - start, FEATURES), dtype=np.float32)
        labels[start:stop] = rng.integers(0, 10, stop - start)
    features.flush()
    labels.flush()
    del features, labels


def loader_for(folder: Path, workers: int):
    return build_loader(
        NpyDataset(folder), batch_size=BATCH, shuffle=True, seed=0, num_workers=workers
    )


def measure(folder: Path, workers: int) -> dict[str, float]:
    """One straight epoch, then a resume at AT of it; seconds."""
    straight = loader_for(folder, workers)
    batches = len(straight)
    at = int(batches * AT)
    started = time.perf_counter()
    mark = None
    expected = None
    for number, batch in enumerate(straight, 1):
        if number == at:
            mark = time.perf_counter() - started
        elif number == at + 1:
            expected = batch
    epoch_s = time.perf_counter() - started

    started = time.perf_counter()
    resumed = loader_for(folder, workers)  # a resumed run builds its loader anew
    resumed.load_state_dict({"epoch": 0, "batches_delivered": at})
    rest = iter(resumed)
    first = next(rest)
    resume_s = time.perf_counter() - started
    remaining = 1 + sum(1 for _ in rest)
    rest_s = time.perf_counter() - started
    assert expected is not None and all(
        torch.equal(a, b) for a, b in zip(first, expected, strict=True)
    ), "the resumed pass's first batch differs from the uninterrupted pass's"
    assert remaining == batches - at, (remaining, batches, at)
    return {
        "batches": batches,
        "resumed_at_batch": at,
        "epoch_s": epoch_s,
        "replay_to_position_s": mark or 0.0,
        "resume_to_first_batch_s": resume_s,
        "resumed_rest_s": rest_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--size-gb", type=float, default=1.0, help="size of the .npy files")
    args = parser.parse_args()
    set_threads(args.threads)

    rows = int(args.size_gb * 1e9 / (FEATURES * 4 + 8))
    folder = Path(tempfile.mkdtemp(prefix="stoker-resume-cost-"))
    checks, figures = [], {}
    try:
        started = time.perf_counter()
        write_npy(folder, rows)
        print(f"wrote {rows:,} rows ({args.size_gb:g} GB) in {time.perf_counter() - started:.0f} s")
        bench = "resume_cost"
        for workers in WORKERS:
            got = measure(folder, workers)
            figures[f"w={workers}"] = got
            ratio = got["resume_to_first_batch_s"] / got["epoch_s"]
            replay = got["replay_to_position_s"] / got["epoch_s"]
            print(
                f"w={workers}: epoch {got['epoch_s']:.1f} s; resume at batch "
                f"{got['resumed_at_batch']} of {got['batches']}: first batch after "
                f"{got['resume_to_first_batch_s']:.3f} s = {ratio:.4f} of the epoch "
                f"(a replay would take {got['replay_to_position_s']:.1f} s = {replay:.2f})",
                flush=True,
            )
            figure, note = (
                f"w={workers} resume at 90% / epoch time",
                f"epoch {got['epoch_s']:.0f} s",
            )
            if args.size_gb >= 1:
                checks.append(target_check(bench, figure, ratio, "<", TARGET, note=note))
            else:  # a short epoch: the fixed costs (a worker's start) weigh more than at 1 GB
                checks.append(info(bench, figure, ratio, note=f"{note}; target is for 1 GB"))
            checks.append(
                info(bench, f"w={workers} replay to 90% / epoch time (fetch and discard)", replay)
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    print(table(checks))
    result = Result(
        benchmark="resume_cost",
        timed="a shuffled epoch of a .npy source through build_loader, and a fresh loader "
        "resumed at 90% of it up to its first batch (both without a model)",
        workload={
            "size_gb": args.size_gb,
            "rows": rows,
            "features": FEATURES,
            "batch_size": BATCH,
            "workers": list(WORKERS),
            "threads": args.threads,
        },
        figures=figures,
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
