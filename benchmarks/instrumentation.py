"""What stoker's per-step measuring costs: the phase timer, and the rest of the bookkeeping.

Phase timing (``stoker.observe.timing.PhaseTimer``): the calls the loop makes every
step on the CPU (``start_step``, ``data_ready``, three ``lap``s — forward, backward,
optimizer; there is no transfer to time on the CPU — ``end_step``) plus the epoch's
``summary``/``reset`` spread over its steps. Measured two ways, both against the
seed workload's step (MLP 20→32→2, fused Adam, batch 64, pre-batched tensors):

- in the loop: the bare training loop, every other step making those calls (odd
  steps in one epoch, even ones in the next); per repeat, the median timed step over
  the median untimed step, minus 1; the figure is the median over the repeats, plus
  the epoch summary's cost spread over an epoch's steps (target: < 1% of step time).
  The same with calls that do nothing is the control: it reads the method's noise
  (and the bare cost of six calls). The spread over the repeats is in the note;
- alone: the same calls in a tight loop, in µs per step (a lower bound: in the loop
  caches are colder, and each of the five clock reads costs several times more).

The other per-step bookkeeping of ``stoker.train.loop.train_step`` — the non-finite
check, running metrics, the lr scheduler, the step loss — is timed alone, per call, for
the record; so is the total gradient norm, which the loop measures only on the first
step of each ``log_every_steps`` window (or every step when clipping by norm).

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
from stoker.examples.datasets import seed_tabular
from stoker.observe.timing import PHASES, PhaseTimer
from stoker.train.grads import GradClipper
from stoker.train.metrics import TaskMetrics
from stoker.train.numerics import FiniteCheck
from stoker.train.optim import build_optimizer, build_scheduler

TIMING_MAX_PCT = 1.0
BATCH = 64


def timed_phases(timer: PhaseTimer) -> None:
    """The PhaseTimer calls train_step makes in one step on the CPU (no gradient
    accumulation; no transfer lap: ``timer.times_transfer`` is False there)."""
    timer.start_step()
    timer.data_ready()
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
    on the machine falls on both kinds alike; which of the two is timed flips from
    epoch to epoch, so neither kind is always the one after the other. Returns the
    step times (one step = stamp to stamp) of the timed and of the untimed steps.
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
    for epoch in range(epochs):
        order = torch.randperm(len(features), generator=generator).split(BATCH)
        batches = [(features[i], labels[i]) for i in order]
        timer.reset()
        last = clock()
        for index, (xb, yb) in enumerate(batches):
            on = index % 2 == epoch % 2
            if on:
                timer.start_step()
                timer.data_ready()
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


def in_loop_pcts(repeats: int, epochs: int) -> dict[str, list[float]]:
    """Per repeat, the timed steps' median over the untimed steps', minus 1, in %: for
    the PhaseTimer ("timer") and for the no-op control ("control"), run by turns; and
    the untimed steps' median, in s ("step_s")."""
    pcts: dict[str, list[float]] = {"timer": [], "control": [], "step_s": []}
    alternating_epochs(1)  # warm-up
    for repeat in range(repeats):
        kinds = [("timer", PhaseTimer), ("control", NullTimer)]
        for name, timer_class in kinds if repeat % 2 == 0 else kinds[::-1]:
            timed, untimed = alternating_epochs(epochs, timer_class)
            pcts[name].append((median(timed) / median(untimed) - 1) * 100)
            pcts["step_s"].append(median(untimed))
    return pcts


def summary_us_per_step(steps: int, repeat: int = 9) -> float:
    """What train_epoch's one ``summary`` (and ``reset``) costs per step of an epoch of
    ``steps`` steps: the stamps are decoded and summarized there, not in the steps."""
    costs = []
    for _ in range(repeat + 1):
        timer = PhaseTimer(torch.device("cpu"))
        for _ in range(steps):
            timed_phases(timer)
        started = time.perf_counter()
        timer.summary()
        timer.reset()
        costs.append((time.perf_counter() - started) * 1e6 / steps)
    return median(costs[1:])  # the first pays numpy's first calls


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
    params = list(model.parameters())
    check = FiniteCheck(params)
    step_loss = loss.detach().float()
    window_losses: list[torch.Tensor] = []
    log_every = 50  # the default train.log_every_steps

    def grad_norm() -> None:  # on a window's first step (every step when clipping by norm)
        clipper.measure([p.grad for p in params if p.grad is not None], wanted=True)

    def step_loss_and_window() -> None:  # the step's loss, kept; summed once per window
        window_losses.append(loss.detach().float())
        if len(window_losses) == log_every:
            torch.stack(window_losses).sum()
            window_losses.clear()

    pieces: dict[str, Callable[[], object]] = {
        "non-finite check (FiniteCheck: loss + every gradient, one read)": lambda: check(step_loss),
        # The loop passes the loss it detached once for the step loss too.
        "TaskMetrics.update": lambda: metrics.update(outputs, yb, step_loss, BATCH),
        "ConstantLR.step (constant schedule)": scheduler.step,
        "step loss + window sum (one stack + sum per window)": step_loss_and_window,
        "grad norm (GradClipper.measure; 1 step in log_every_steps)": grad_norm,
    }
    return {name: per_call_us(fn) for name, fn in pieces.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    bench = "instrumentation"

    repeats = args.rounds or 7
    epochs = 8
    print(
        f"phase timer in the loop: {repeats} repeats of {epochs} epochs, every other step "
        "timed, and the no-op control",
        flush=True,
    )
    pcts = in_loop_pcts(repeats, epochs)
    step_s = median(pcts["step_s"])
    steps_per_epoch = -(-len(seed_tabular()) // BATCH)
    summary_us = summary_us_per_step(steps_per_epoch)
    summary_pct = summary_us / (step_s * 1e6) * 100
    in_loop_pct = median(pcts["timer"]) + summary_pct
    control_pct = median(pcts["control"])

    timer = PhaseTimer(torch.device("cpu"))
    calls_us = per_call_us(lambda: timed_phases(timer), number=steps_per_epoch)
    alone_us = calls_us + summary_us

    def spread(values: list[float]) -> str:
        return f"{min(values):+.2f}% to {max(values):+.2f}%"

    checks = [
        info(bench, "seed step without timing (bare loop)", step_s * 1e6, unit="us"),
        target_check(
            bench,
            "phase timing cost in the loop, % of step",
            in_loop_pct,
            "<",
            TIMING_MAX_PCT,
            unit="%",
            note=f"median of {repeats} repeats ({spread(pcts['timer'])}) + the epoch "
            f"summary {summary_pct:.2f}%",
        ),
        info(
            bench,
            "control: the same with no-op timer calls, % of step",
            control_pct,
            unit="%",
            note=f"the method's noise and 7 empty calls ({spread(pcts['control'])})",
        ),
        info(bench, "epoch summary per step (decode + statistics)", summary_us, unit="us"),
        info(bench, "phase timing alone per step", alone_us, unit="us"),
        info(bench, "phase timing alone, % of step", alone_us / (step_s * 1e6) * 100, unit="%"),
    ]
    costs = bookkeeping_costs()
    for name, us in costs.items():
        checks.append(info(bench, f"alone: {name}", us, unit="us"))
    every_step = sum(us for name, us in costs.items() if not name.startswith("grad norm"))
    checks.append(
        info(
            bench,
            "alone: other bookkeeping of every step, % of step",
            every_step / (step_s * 1e6) * 100,
            unit="%",
        )
    )
    print(table(checks))
    result = Result(
        benchmark="instrumentation",
        timed="in the loop: median step time (stamp to stamp) of the bare seed loop's "
        "steps with and without the PhaseTimer calls, alternating step by step, median "
        "over repeats, plus the epoch summary per step; alone: timeit of the calls, µs "
        "per step",
        workload={
            "phases": list(PHASES),
            "repeats": repeats,
            "epochs": epochs,
            "threads": args.threads,
        },
        figures={
            "in_loop_pct": pcts["timer"],
            "control_pct": pcts["control"],
            "summary_pct": summary_pct,
            "untimed_step_s": pcts["step_s"],
            "timer_calls_us": calls_us,
            "timer_summary_us_per_step": summary_us,
            "bookkeeping_us": costs,
        },
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
