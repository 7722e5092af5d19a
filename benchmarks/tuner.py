"""The loader tuner against an exhaustive sweep of the same search space, in one process.

The workload is one where workers matter: every ``__getitem__`` does a moderate amount
of pure-Python CPU work. Both searches use the same measurement (the training loader
alone, ``stoker.observe.tune.LoaderMeasure``); the sweep measures every candidate for
``--final-s`` seconds, the tuner (successive halving) measures every candidate briefly
and only the survivors for longer, up to ``--final-s``.

Reported, as ratios:

- choice: the sweep's rate of the tuner's winner / the sweep's best rate (target >= 0.9);
- time: the tuner's wall time / the sweep's wall time (target <= 0.25).

Run (``--trials 3`` alternates which goes first, against drift on a shared machine):

    OMP_NUM_THREADS=1 python benchmarks/tuner.py --trials 3 --out bench-out

(``OMP_NUM_THREADS=1`` keeps OpenMP barriers from stalling the main process when the
cores are shared.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

from stoker.config import validate_config
from stoker.observe.stages import usable_cores
from stoker.observe.tune import Candidate, LoaderMeasure, search_space, successive_halving
from stoker.train.pipeline import build_pipeline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BusySamples


def busy_samples(n: int = 8192, features: int = 16, work: int = 3000) -> Dataset:
    return BusySamples(n, features, work)


def small_mlp(in_features: int = 16, out_features: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, out_features))


def one_trial(space: list[Candidate], measure: LoaderMeasure, args, *, sweep_first: bool) -> dict:
    """The tuner and the sweep once each (in the given order), printed and returned."""

    def run_tuner() -> tuple[object, float]:
        started = time.perf_counter()
        return successive_halving(
            space, measure, final_s=args.final_s
        ), time.perf_counter() - started

    def run_sweep() -> tuple[dict[Candidate, float], float]:
        started = time.perf_counter()
        rates = {candidate: measure(candidate, args.final_s) for candidate in space}
        return rates, time.perf_counter() - started

    if sweep_first:
        (sweep, sweep_s), (halving, tuner_s) = run_sweep(), run_tuner()
    else:
        (halving, tuner_s), (sweep, sweep_s) = run_tuner(), run_sweep()
    best = max(sweep, key=lambda c: sweep[c])
    choice = sweep[halving.winner] / sweep[best]
    time_ratio = tuner_s / sweep_s
    print(f"{'candidate':58} {'sweep samples/s':>16} {'tuner':>24}")
    for candidate in sorted(space, key=lambda c: -sweep[c]):
        trial = halving.last_trial(candidate)
        tuned = f"{trial.samples_per_s:,.0f} (round {trial.round + 1})" if trial else "-"
        mark = " <- tuner" if candidate == halving.winner else ""
        mark += " <- sweep best" if candidate == best else ""
        print(f"{candidate.label():58} {sweep[candidate]:>16,.0f} {tuned:>24}{mark}")
    print(
        f"choice: {sweep[halving.winner]:,.0f} vs best {sweep[best]:,.0f} samples/s "
        f"= {choice:.3f}x (target >= 0.9)"
    )
    print(f"time:   tuner {tuner_s:.1f} s vs sweep {sweep_s:.1f} s = {time_ratio:.3f}x", end="")
    print(f" (target <= 0.25); measurements: tuner {len(halving.trials)}, sweep {len(space)}")

    # The sweep's best is the maximum of noisy measurements, biased upwards; measuring
    # the two again, interleaved, gives a fairer ratio on a busy machine.
    again: dict[Candidate, list[float]] = {halving.winner: [], best: []}
    for _ in range(args.remeasure if halving.winner != best else 0):
        for candidate in again:
            again[candidate].append(measure(candidate, args.final_s))
    remeasured = 1.0
    if halving.winner != best and args.remeasure:
        remeasured = statistics.median(again[halving.winner]) / statistics.median(again[best])
        print(
            f"choice, both measured again {args.remeasure}x interleaved: "
            f"{statistics.median(again[halving.winner]):,.0f} vs "
            f"{statistics.median(again[best]):,.0f} samples/s = {remeasured:.3f}x"
        )
    return {
        "order": "sweep, tuner" if sweep_first else "tuner, sweep",
        "tuner": {
            "winner": dataclasses.asdict(halving.winner),
            "wall_s": tuner_s,
            "measured_s": halving.spent_s,
            "measurements": len(halving.trials),
        },
        "sweep": {
            "best": dataclasses.asdict(best),
            "wall_s": sweep_s,
            "rates": [{"candidate": c.label(), "samples_per_s": r} for c, r in sweep.items()],
        },
        "choice_ratio": choice,
        "choice_ratio_remeasured": remeasured,
        "remeasured_rates": {c.label(): rates for c, rates in again.items()},
        "time_ratio": time_ratio,
        "load_average_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--final-s", type=float, default=3.0, help="seconds per candidate")
    parser.add_argument("--work", type=int, default=3000, help="Python iterations per sample")
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--trials", type=int, default=1, help="tuner + sweep pairs, order alternating"
    )
    parser.add_argument(
        "--remeasure", type=int, default=3, help="measure winner and best again, interleaved"
    )
    parser.add_argument("--out", type=Path, default=None, help="write tuner.json here")
    args = parser.parse_args()

    here = Path(__file__).resolve()
    config = validate_config(
        {
            "name": "tuner-bench",
            "model": {"name": f"{here}:small_mlp"},
            "data": {
                "train": {
                    "name": f"{here}:busy_samples",
                    "args": {"n": args.samples, "work": args.work},
                }
            },
            "loader": {"batch_size": args.batch_size},
            "train": {"device": "cpu"},
        }
    )
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    pipeline = build_pipeline(config)
    measure = LoaderMeasure(config, pipeline)
    cores = usable_cores()
    space = search_space(
        cores=cores,
        baseline=Candidate(num_workers=0),
        cuda=False,
        batched=pipeline.train_loader.returns_batches,
    )
    print(f"{len(space)} candidates, {cores} cores, {args.final_s:g} s per candidate in the sweep")
    trials = []
    for index in range(args.trials):
        print(f"--- trial {index + 1} of {args.trials}")
        trials.append(one_trial(space, measure, args, sweep_first=index % 2 == 1))
    summary = {
        key: statistics.median(t[key] for t in trials)
        for key in ("choice_ratio", "choice_ratio_remeasured", "time_ratio")
    }
    print(
        f"median over {len(trials)} trial(s): choice {summary['choice_ratio']:.3f}x "
        f"(remeasured {summary['choice_ratio_remeasured']:.3f}x, target >= 0.9), "
        f"time {summary['time_ratio']:.3f}x (target <= 0.25)"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "tuner",
            "machine": {
                "cores": cores,
                "python": platform.python_version(),
                "torch": torch.__version__,
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            },
            "workload": {"work": args.work, "samples": args.samples, "batch_size": args.batch_size},
            "final_s": args.final_s,
            "candidates": len(space),
            "trials": trials,
            "median": summary,
            "targets": {"choice_ratio_min": 0.9, "time_ratio_max": 0.25},
        }
        path = args.out / "tuner.json"
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
