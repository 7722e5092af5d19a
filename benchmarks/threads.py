"""train.threads under a busy machine: PyTorch's default thread count vs ``auto``.

Workload: the seed MLP (20→32→2, Adam, batch 64) trained by ``stoker.fit`` for a fixed
number of steps, while ``--hogs`` other processes (default: one per usable core) each
spin a core in pure Python, as other jobs on a shared machine do. Contenders, alternating
round by round after a warm-up round:

- ``default``: ``train.threads`` set to what PyTorch starts with, one thread per core
  (``torch.get_num_threads()`` in a fresh process, without OMP_NUM_THREADS);
- ``auto``: ``train.threads: auto``, stoker's default, which sees the busy cores.

Timed: the median step (forward to forward, as in trainer.py) and the train time.
Target: default / auto train time >= 1.5 (the run no longer collapses). The 1-minute
load average is recorded before and after.

    python benchmarks/threads.py --out bench-out
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Result,
    Timed,
    column,
    info,
    interleaved,
    median,
    paired_ratio,
    seed_model,
    spread,
    table,
    target_check,
    weights_of,
)

import stoker
from stoker.examples.datasets import seed_tabular
from stoker.train.threads import usable_cores

SPEEDUP_MIN = 1.5


def _spin(stop) -> None:  # type: ignore[no-untyped-def]
    """Keep one core busy until ``stop`` is set."""
    x = 0
    while not stop.is_set():
        for _ in range(10_000):
            x = (x * 31 + 7) % 1_000_003


def _torch_default_threads() -> int:
    """What PyTorch starts with in a fresh process without OMP_NUM_THREADS."""
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        env=environment,
        check=True,
    )
    return int(out.stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None, help="ignored (run_all passes it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120, help="optimizer steps per run")
    parser.add_argument("--hogs", type=int, default=None, help="CPU-bound competitors")
    args = parser.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)
    cores = usable_cores()
    default_threads = _torch_default_threads()
    hogs = args.hogs if args.hogs is not None else cores
    arrays = seed_tabular()
    steps_per_epoch = -(-len(arrays) // 64)
    init = weights_of(seed_model())
    root = Path(tempfile.mkdtemp(prefix="stoker-threads-"))
    chosen: list[int] = []

    def fit(threads: int | str):
        def run(model):
            result = stoker.fit(
                model,
                arrays,
                epochs=1,
                max_steps=args.steps,
                batch_size=64,
                optimizer="adam",
                lr=1e-2,
                seed=0,
                threads=threads,
                progress="quiet",
                tensorboard=False,
                enabled=False,
                run_dir=tempfile.mkdtemp(dir=root),
            )
            env = (result.run_dir / "environment.json").read_text()
            if threads == "auto":
                chosen.append(int(env.split('"torch_threads": ')[1].split(",")[0]))
            return {}

        return run

    contenders = {
        "default": Timed(init, steps_per_epoch, fit(default_threads)),
        "auto": Timed(init, steps_per_epoch, fit("auto")),
    }
    stop = multiprocessing.Event()
    workers = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(hogs)]
    for worker in workers:
        worker.start()
    time.sleep(1.0)  # the hogs are running before the first run samples the cores
    load_before = os.getloadavg()[0]
    try:
        records = interleaved(contenders, rounds=args.rounds)  # type: ignore[arg-type]
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    load_after = os.getloadavg()[0]
    bench = "threads"
    checks = [
        info(bench, "usable cores / CPU-bound competitors", float(cores), unit=f"/ {hogs}"),
        info(bench, "threads: PyTorch default", float(default_threads), unit=""),
        info(bench, "threads: auto chose (median)", float(median(chosen)), unit=""),
        info(
            bench,
            "default: median step",
            median(column(records["default"], "step_s")) * 1e6,
            unit="us",
        ),
        info(
            bench, "auto: median step", median(column(records["auto"], "step_s")) * 1e6, unit="us"
        ),
        target_check(
            bench,
            "train time default threads / auto, under load",
            paired_ratio(column(records["default"], "train_s"), column(records["auto"], "train_s")),
            ">=",
            SPEEDUP_MIN,
        ),
        info(bench, "load average 1 min before / after", load_before, unit=f"/ {load_after:.1f}"),
    ]
    print(table(checks))
    result = Result(
        benchmark="threads",
        timed="median step (forward to forward) and train time of stoker.fit, under load",
        workload={
            "model": "seed MLP 20-32-2",
            "steps": args.steps,
            "hogs": hogs,
            "rounds": args.rounds,
        },
        figures={
            "train_s": {k: spread(column(v, "train_s")) for k, v in records.items()},
            "step_s": {k: spread(column(v, "step_s")) for k, v in records.items()},
            "auto_threads": chosen,
            "load_before": load_before,
            "load_after": load_after,
        },
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
