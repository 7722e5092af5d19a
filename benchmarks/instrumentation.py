"""What stoker's per-step measuring costs: the phase timer, and the rest of the bookkeeping.

Everything is measured inside the seed workload's training loop, by paired neighbours
(``in_loop.py``: every other step carries the piece; each such step is compared with
the plain steps either side of it), because a piece costs two to five times more in a
training step than in a tight ``timeit`` loop.

Phase timing (``stoker.observe.timing.PhaseTimer``): what the loop does every step on
the CPU — four clock reads into locals (the step's start, which also ends the step
before, the batch's arrival, and the ends of forward and of backward: there is no
transfer to time on the CPU) and one ``timer.record`` of them, a list append — plus the
epoch's ``close_step``/``summary``/``reset`` spread over its steps. Target: < 1% of the
step, the median over the repeats. The same calls to builtins that do nothing are the
control: they read the method's bias and the bare cost of the calls. The same in a
tight loop is shown for comparison.

The rest of the loop's step bookkeeping, each piece in the loop the same way: the
non-finite check (one fused kernel over the gradients and a read of the loss), the
running metrics, the step loss kept for the step record; and the whole step as
``stoker.fit`` makes it by default (``stoker.train.loop.plain_step``: fp32, constant lr,
no clipping, ``on_nonfinite=halt``, gradient health every 100 steps) against the seed's
loop body —
the trainer's own cost per step, without the noise of whole runs that
``trainer.py``'s overhead figure carries. The total gradient norm, which the loop
measures only on the first step of each ``log_every_steps`` window (or every step when
clipping by norm), is timed alone.

    python benchmarks/instrumentation.py --out bench-out
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
import time
import timeit
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
from in_loop import BATCH, Piece, measure

from stoker.data.prefetch import DevicePrefetcher
from stoker.examples.datasets import seed_tabular
from stoker.observe.progress import QuietProgress
from stoker.observe.sinks import NullSink
from stoker.observe.system import SystemMonitor
from stoker.observe.timing import PHASES, PhaseTimer
from stoker.train.grad_health import GradHealth
from stoker.train.grads import FiniteCheck, GradClipper
from stoker.train.loop import Loop, plain_step
from stoker.train.metrics import StepWindow, TaskMetrics
from stoker.train.monitor import Monitor
from stoker.train.optim import ConstantLR
from stoker.train.precision import Precision
from stoker.train.state import TrainState

TIMING_MAX_PCT = 1.0
CPU = torch.device("cpu")


def timed_phases(timer: PhaseTimer, batches: Iterator[object]) -> None:
    """The timing the loop's step does in one step on the CPU (no gradient accumulation; no
    transfer to time: ``timer.times_transfer`` is False there)."""
    now = timer.now
    fetching = now()
    next(batches)
    fetched = now()
    forwarded = now()
    timer.record((fetching, fetched, fetched, forwarded, now()))


class NullTimer(PhaseTimer):
    """The same calls doing nothing: the A/A control of the alternating measurement."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.now = float  # type: ignore[assignment]  # a builtin returning 0.0
        self.record = len  # type: ignore[assignment]  # a builtin that keeps nothing


def timer_piece(timer_class: type[PhaseTimer]) -> Callable[..., Piece]:
    """The loop's clock readings around the seed step, as its step takes them; the
    epoch's summary after."""

    def make(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module) -> Piece:
        timer = timer_class(CPU)

        def step(batches: Iterator[Any]) -> None:
            now = timer.now
            fetching = now()
            xb, yb = next(batches)
            fetched = now()
            loss = loss_fn(model(xb), yb)
            forwarded = now()
            optimizer.zero_grad()
            loss.backward()
            timer.record((fetching, fetched, fetched, forwarded, now()))
            optimizer.step()

        def end_epoch() -> None:  # what train_epoch reads once per epoch, outside the steps
            timer.close_step()
            timer.summary()
            timer.reset()

        return Piece(step, end_epoch)

    return make


def after_backward(
    build: Callable[[nn.Module], Callable[[torch.Tensor, torch.Tensor, torch.Tensor], object]],
) -> Callable[..., Piece]:
    """The seed step with a piece of bookkeeping between backward and the optimizer step
    (where the loop's step does its own); ``build(model)`` makes the piece."""

    def make(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module) -> Piece:
        piece = build(model)

        def step(batches: Iterator[Any]) -> None:
            xb, yb = next(batches)
            outputs = model(xb)
            loss = loss_fn(outputs, yb)
            optimizer.zero_grad()
            loss.backward()
            piece(outputs, yb, loss)
            optimizer.step()

        return Piece(step)

    return make


def finite_check(model: nn.Module) -> Callable[..., object]:
    check = FiniteCheck(list(model.parameters()))
    return lambda outputs, targets, loss: check(loss)


def running_metrics(model: nn.Module) -> Callable[..., object]:
    metrics = TaskMetrics("classification")
    return lambda outputs, targets, loss: metrics.update(outputs, targets, loss, BATCH)


def step_loss(model: nn.Module) -> Callable[..., object]:
    window = StepWindow.empty(CPU)

    def keep(outputs: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor) -> None:
        nonlocal window
        # The loop adds the host number its non-finite check already read (loss_value).
        window.loss_sum += 0.5
        window.losses += 1
        window.steps += 1
        if window.steps == 50:  # the default log_every_steps: a new window
            window = StepWindow.empty(CPU)

    return keep


def whole_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: nn.Module,
    *,
    torch_calls: bool = False,
) -> Piece:
    """The step ``stoker.fit`` makes by default (``plain_step``, built again each epoch
    as ``train_epoch`` does), on the same model and optimizer; ``train_epoch``'s step
    records are left out (one in 50 steps).

    ``torch_calls``: the optimizer's own ``step()`` and ``zero_grad()`` instead of the
    loop's (``stoker.train.optim_calls``: the same ``step()``, gradients set to None),
    so that the difference is the bookkeeping alone.
    """
    loop = Loop(
        model=model,
        optimizer=optimizer,
        scheduler=ConstantLR(optimizer),
        precision=Precision("fp32", CPU),
        clipper=GradClipper(),
        loss_fn=loss_fn,
        loss_name="cross_entropy",
        task="classification",
        train_loader=None,
        val_loader=None,
        device=CPU,
        state=TrainState(),
        sink=NullSink(),
        progress=QuietProgress(),
        monitor=Monitor("train/loss", "min"),
        on_epoch_end=lambda loop, record: None,
        timer=PhaseTimer(CPU),
        system=SystemMonitor(CPU),
        health=GradHealth(100, optimizer_kind="adam"),
        prefetcher=DevicePrefetcher(CPU),
        epochs=1,
    )
    if torch_calls:
        loop.optimizer_calls.step = optimizer.step  # type: ignore[method-assign]
        loop.optimizer_calls.zero_grad = lambda: optimizer.zero_grad(set_to_none=True)  # type: ignore[method-assign]
    metrics = TaskMetrics("classification")
    parts: dict[str, Any] = {"metrics": metrics, "window": StepWindow.empty(CPU)}
    parts["step"] = plain_step(loop, metrics)
    assert parts["step"] is not None, "stoker.fit's defaults take the plain step"

    def step(batches: Iterator[Any]) -> None:
        if parts["window"].steps >= 50:
            parts["window"] = StepWindow.empty(CPU)
        parts["step"](batches, parts["window"])

    def end_epoch() -> None:
        parts["metrics"].compute("train")
        parts["metrics"] = TaskMetrics("classification")
        parts["step"] = plain_step(loop, parts["metrics"])
        loop.timer.close_step()
        loop.timer.summary()
        loop.timer.reset()

    return Piece(step, end_epoch)


def summary_us_per_step(steps: int, repeat: int = 9) -> float:
    """What train_epoch's one ``summary`` (and ``reset``) costs per step of an epoch of
    ``steps`` steps: the stamps are decoded and summarized there, not in the steps."""
    costs = []
    for _ in range(repeat + 1):
        timer = PhaseTimer(torch.device("cpu"))
        batches = iter(range(steps))
        for _ in range(steps):
            timed_phases(timer, batches)
        started = time.perf_counter()
        timer.close_step()
        timer.summary()
        timer.reset()
        costs.append((time.perf_counter() - started) * 1e6 / steps)
    return median(costs[1:])  # the first pays numpy's first calls


def per_call_us(fn: Callable[[], object], number: int = 2000, repeat: int = 7) -> float:
    fn()
    return median([timeit.timeit(fn, number=number) / number * 1e6 for _ in range(repeat)])


def grad_norm_us() -> float:
    """The total gradient norm alone (µs): measured on a window's first step only."""
    model = seed_model()
    xb, yb = seed_tabular().__getitems__(torch.arange(BATCH))
    nn.CrossEntropyLoss()(model(xb), yb).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    clipper = GradClipper()
    return per_call_us(lambda: clipper.measure(grads, wanted=True))


BOOKKEEPING: dict[str, Callable[..., Piece]] = {
    "non-finite check (FiniteCheck)": after_backward(finite_check),
    "running metrics (TaskMetrics.update)": after_backward(running_metrics),
    "step loss kept for the step record": after_backward(step_loss),
}
WHOLE_STEP = "the loop's step (stoker.fit's defaults) over the seed's step"
BOOKKEEPING_ALONE = "the same, with torch.optim's own step() and zero_grad()"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    bench = "instrumentation"

    repeats = args.rounds or 7
    epochs = 8
    print(
        f"in the loop: {repeats} repeats of {epochs} epochs, every other step with the piece: "
        "the phase timer, its no-op control, the bookkeeping and the loop's whole step",
        flush=True,
    )
    pieces: dict[str, Callable[..., Piece]] = {
        "timer": timer_piece(PhaseTimer),
        "control": timer_piece(NullTimer),
        **BOOKKEEPING,
        WHOLE_STEP: whole_train_step,
        BOOKKEEPING_ALONE: functools.partial(whole_train_step, torch_calls=True),
    }
    pcts, step_s = measure(pieces, repeats=repeats, epochs=epochs)
    step_us = step_s * 1e6
    steps_per_epoch = -(-len(seed_tabular()) // BATCH)
    summary_us = summary_us_per_step(steps_per_epoch)
    summary_pct = summary_us / step_us * 100
    # The piece's end_epoch already ran the summary, but outside the timed steps.
    in_loop_pct = median(pcts["timer"]) + summary_pct

    timer = PhaseTimer(CPU)
    endless = itertools.repeat(None)
    calls_us = per_call_us(lambda: timed_phases(timer, endless), number=steps_per_epoch)
    alone_us = calls_us + summary_us

    def spread(values: list[float]) -> str:
        return f"{min(values):+.2f}% to {max(values):+.2f}%"

    def us(name: str) -> float:
        return median(pcts[name]) * step_us / 100

    checks = [
        info(bench, "seed step (bare loop)", step_us, unit="us"),
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
            median(pcts["control"]),
            unit="%",
            note=f"the method's bias and 5 calls to do-nothing builtins "
            f"({spread(pcts['control'])})",
        ),
        info(bench, "epoch summary per step (decode + statistics)", summary_us, unit="us"),
        info(bench, "phase timing alone (tight loop) per step", alone_us, unit="us"),
    ]
    for name in BOOKKEEPING:
        checks.append(
            info(bench, f"in the loop: {name}", us(name), unit="us", note=spread(pcts[name]))
        )
    for name in (WHOLE_STEP, BOOKKEEPING_ALONE):
        checks.append(
            info(
                bench,
                f"in the loop: {name}",
                us(name),
                unit="us",
                note=f"{median(pcts[name]):.1f}% of the step ({spread(pcts[name])})",
            )
        )
    norm_us = grad_norm_us()
    checks.append(info(bench, "alone: grad norm (1 step in log_every_steps)", norm_us, unit="us"))
    print(table(checks))
    result = Result(
        benchmark="instrumentation",
        timed="in the loop (in_loop.py): the seed loop's steps with and without the piece, "
        "alternating step by step; the median difference between each step with it and its "
        "two neighbours without, over the median plain step; median over repeats. The "
        "timer's figure adds the epoch summary per step; alone: timeit, µs per step",
        workload={
            "phases": list(PHASES),
            "repeats": repeats,
            "epochs": epochs,
            "threads": args.threads,
        },
        figures={
            "in_loop_pct": pcts,
            "plain_step_s": step_s,
            "summary_pct": summary_pct,
            "timer_calls_us": calls_us,
            "timer_summary_us_per_step": summary_us,
            "grad_norm_us": norm_us,
        },
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
