"""Exercise 8 — The GPU pipeline, measured: data loading, transfer, forward, backward, total.

Dataset → DataLoader → GPU transfer → model → loss → backward → optimizer is what
``stoker.fit`` runs, and it times each phase of every step (CUDA events on a GPU,
``perf_counter`` on the CPU). The epoch record holds each phase's total
(``time/data_wait_s``, ``time/transfer_s``, ``time/forward_s``, ``time/backward_s``,
``time/optimizer_s``) and the median step (``time/step_s``); ``summary.json`` in the
run dir holds per-step medians, shares and the verdict: what bounds the run, and the fix.

The GPU is used when there is one (``device="auto"``); on a CPU "transfer" is ~0.

Run: python examples/exercises/ex8_pipeline.py
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import stoker
from stoker.examples.datasets import seed_tabular

PHASES = ("data_wait", "transfer", "forward", "backward", "optimizer")


def main(
    rows: int = 10_000, epochs: int = 2, batch_size: int = 256, runs_root: str | Path = "runs"
) -> dict[str, object]:
    """Returns per-step medians (ms) per phase, the epoch totals (s) and the verdict."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 2))  # fmt: skip
    result = stoker.fit(
        model,
        seed_tabular(n_rows=rows),  # the seeds' CSVWindowDataset: 20 features, 2 classes
        epochs=epochs,
        batch_size=batch_size,
        optimizer="adamw",
        lr=1e-3,
        device="auto",
        runs_root=str(runs_root),
        name="ex8-pipeline",
        progress="plain",  # the epoch lines and stoker's phase table
    )
    summary = json.loads((result.run_dir / "summary.json").read_text())
    last = result.metrics
    print(f"\ndevice: {next(result.model.parameters()).device}")
    print(f"{'phase':<10} {'per step ms':>12} {'last epoch s':>13}")
    medians = {}
    for phase in (*PHASES, "step"):
        medians[phase] = summary["phases"][phase]["median_ms"]
        total = last[f"time/{phase}_s"] if phase != "step" else last["time/epoch_s"]
        print(f"{phase:<10} {medians[phase]:>12.3f} {total:>13.3f}")
    print(f"verdict: {summary['verdict']} — {summary['recommendation']}")
    return {
        "median_ms": medians,
        "epoch_totals_s": {phase: last[f"time/{phase}_s"] for phase in PHASES},
        "epoch_s": last["time/epoch_s"],
        "data_stall_pct": summary["data_stall_pct"],
        "verdict": summary["verdict"],
        "run_dir": str(result.run_dir),
    }


if __name__ == "__main__":
    main()
