"""What stoker's per-step measuring costs: the phase timer, and the rest of the bookkeeping.

Phase timing (``stoker.observe.timing.PhaseTimer``): the calls the loop makes every
step (``start_step``, ``data_ready``, four ``lap``s, ``end_step``) plus the epoch's
``summary``/``reset`` spread over its steps. Measured two ways, both against the
seed workload's step (MLP 20→32→2, fused Adam, batch 64, pre-batched tensors):

- in the loop: the bare training loop, every other step making those calls; the
  figure is the median timed step (plus the summary's share) over the median untimed
  step, minus 1 (target: < 1% of step time);
- alone: the same calls in a tight loop, in µs per step (a lower bound: in the loop
  caches are colder).

The other per-step bookkeeping of ``stoker.train.loop.train_step`` — total gradient
norm, non-finite check, running metrics, the lr scheduler, loss weighting — is timed
alone, per call, for the record (``prototypes.py`` measures removing each in the loop).

    python benchmarks/instrumentation.py --out bench-out
"""

from __future__ import annotations

import argparse
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Result,
    add_common_arguments,
    info,
    median,
    seed_model,
    set_threads,
    table,
    target_check,
)

from stoker.config import OptimConfig, ScheduleConfig
from stoker.data.device import move_to_device
from stoker.examples.datasets import seed_tabular
from stoker.observe.timing import PHASES, PhaseTimer
from stoker.train.grads import GradClipper
from stoker.train.metrics import TaskMetrics
from stoker.train.optim import build_optimizer, build_scheduler

TIMING_MAX_PCT = 1.0
BATCH = 64


def timed_phases(timer: PhaseTimer) -> None:
    """The PhaseTimer calls train_step makes in one step (no gradient accumulation)."""
    timer.start_step()
    timer.data_ready()
    timer.lap("transfer")
    timer.lap("forward")
    timer.lap("backward")
    timer.lap("optimizer")
    timer.end_step()


class NullTimer(PhaseTimer):
    """The same calls doing nothing: the A/A control of the alternating measurement."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # PhaseTimer binds fast per-instance calls on the CPU; use the no-op methods below.
        for name in ("start_step", "data_ready", "lap", "end_step"):
            self.__dict__.pop(name, None)

    def start_step(self) -> None:
        pass

    def data_ready(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def end_step(self) -> None:
        pass


def alternating_epochs(
    epochs: int, timer_class: type[PhaseTimer] | None = None
) -> tuple[list[float], list[float]]:
    """The bare loop over pre-batched tensors, its steps alternately timed and not.

    Every other step makes the PhaseTimer calls, so a burst of load from elsewhere
    on the machine falls on both kinds alike. Returns the step times (one step =
    stamp to stamp) of the timed and of the untimed steps.
    """
    arrays = seed_tabular()
    features, labels = arrays.arrays
    generator = torch.Generator().manual_seed(0)
    model = seed_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    timer = (timer_class or PhaseTimer)(torch.device("cpu"))
    clock = time.perf_counter
    timed: list[float] = []
    untimed: list[float] = []
    for _ in range(epochs):
        order = torch.randperm(len(features), generator=generator).split(BATCH)
        batches = [(features[i], labels[i]) for i in order]
        timer.reset()
        last = clock()
        for index, (xb, yb) in enumerate(batches):
            on = index % 2 == 0
            if on:
                timer.start_step()
                timer.data_ready()
                timer.lap("transfer")
            loss = loss_fn(model(xb), yb)
            if on:
                timer.lap("forward")
            optimizer.zero_grad()
            loss.backward()
            if on:
                timer.lap("backward")
            optimizer.step()
            if on:
                timer.lap("optimizer")
                timer.end_step()
            now = clock()
            (timed if on else untimed).append(now - last)
            last = now
        timer.summary()  # what train_epoch reads once per epoch, outside the steps
    return timed, untimed


def per_call_us(fn: Callable[[], object], number: int = 2000, repeat: int = 7) -> float:
    fn()
    return median([timeit.timeit(fn, number=number) / number * 1e6 for _ in range(repeat)])


def bookkeeping_costs() -> dict[str, float]:
    """The other per-step pieces of train_step, each timed alone (µs per call)."""
    device = torch.device("cpu")
    model = seed_model()
    arrays = seed_tabular()
    xb, yb = arrays.__getitems__(torch.arange(BATCH))
    loss_fn = nn.CrossEntropyLoss()
    outputs = model(xb)
    loss = loss_fn(outputs, yb)
    loss.backward()
    optimizer = build_optimizer(model, OptimConfig(name="adam", lr=1e-2), device=device)
    scheduler = build_scheduler(optimizer, ScheduleConfig(), total_steps=10**9)
    optimizer.step()  # an optimizer step before the scheduler's, as in the loop
    clipper = GradClipper()
    metrics = TaskMetrics("classification")
    norm = clipper.clip_(model.parameters())
    step_loss = torch.zeros(())

    def finite_check() -> None:  # as stoker.train.loop._halt_on_nonfinite reads it
        torch.isfinite(torch.stack([step_loss, norm.float()])).tolist()

    def loss_weighting() -> None:  # zeros, loss * (size / count), the step-loss sum
        total = torch.zeros((), device=device)
        loss * 1.0
        total += loss.detach().float() * 1.0

    window_loss, window_norm = torch.zeros(()), torch.zeros(())

    def window() -> None:
        window_loss.add_(step_loss)
        window_norm.add_(norm.detach().float().to(device))

    pieces: dict[str, Callable[[], object]] = {
        "grad norm (GradClipper.clip_, no clipping)": lambda: clipper.clip_(model.parameters()),
        "non-finite check (stack + isfinite + tolist)": finite_check,
        "TaskMetrics.update": lambda: metrics.update(outputs, yb, loss, BATCH),
        "LambdaLR.step (constant schedule)": scheduler.step,
        "loss weighting + step loss": loss_weighting,
        "window sums": window,
        "move_to_device (CPU to CPU)": lambda: move_to_device((xb, yb), device),
    }
    return {name: per_call_us(fn) for name, fn in pieces.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    bench = "instrumentation"

    epochs = args.rounds or 30
    print(f"phase timer in the loop: {epochs} epochs, every other step timed", flush=True)
    alternating_epochs(1)  # warm-up
    timed, untimed = alternating_epochs(epochs)
    step_s = median(untimed)
    # Control: the same alternation with calls that do nothing should read about 0.
    null_timed, null_untimed = alternating_epochs(epochs, NullTimer)
    control_pct = (median(null_timed) / median(null_untimed) - 1) * 100

    timer = PhaseTimer(torch.device("cpu"))
    calls_us = per_call_us(lambda: timed_phases(timer), number=157)
    started = time.perf_counter()
    timer.summary()  # one epoch's worth of steps queued above, many times over
    summary_us = (time.perf_counter() - started) * 1e6 / max(timer.steps, 1)
    timer.reset()
    alone_us = calls_us + summary_us

    # The epoch summary is read once per epoch: spread over its steps, like the calls.
    in_loop_pct = ((median(timed) + summary_us * 1e-6) / step_s - 1) * 100
    checks = [
        info(bench, "seed step without timing (bare loop)", step_s * 1e6, unit="us"),
        target_check(
            bench,
            "phase timing cost in the loop, % of step",
            in_loop_pct,
            "<",
            TIMING_MAX_PCT,
            unit="%",
            note=f"median timed step {median(timed) * 1e6:.1f} us vs untimed "
            f"{step_s * 1e6:.1f} us, {len(timed)} + {len(untimed)} steps",
        ),
        info(
            bench,
            "control: the same with no-op timer calls, % of step",
            control_pct,
            unit="%",
            note="what the method reads when nothing is timed (7 empty calls)",
        ),
        info(bench, "phase timing alone per step", alone_us, unit="us"),
        info(bench, "phase timing alone, % of step", alone_us / (step_s * 1e6) * 100, unit="%"),
    ]
    costs = bookkeeping_costs()
    for name, us in costs.items():
        checks.append(info(bench, f"alone: {name}", us, unit="us"))
    checks.append(
        info(
            bench,
            "alone: all other bookkeeping, % of step",
            sum(costs.values()) / (step_s * 1e6) * 100,
            unit="%",
        )
    )
    print(table(checks))
    result = Result(
        benchmark="instrumentation",
        timed="in the loop: median step time (stamp to stamp) of the bare seed loop's "
        "steps with and without the PhaseTimer calls, alternating step by step, plus the "
        "epoch summary per step; alone: timeit of the calls, µs per step",
        workload={"phases": list(PHASES), "epochs": epochs, "threads": args.threads},
        figures={
            "timed_step_s": {"median": median(timed), "n": len(timed)},
            "untimed_step_s": {"median": step_s, "n": len(untimed)},
            "control_pct": control_pct,
            "timer_calls_us": calls_us,
            "timer_summary_us_per_step": summary_us,
            "bookkeeping_us": costs,
        },
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
