"""Where stoker's step is slower than a hand loop's, phase by phase.

``trainer.py`` times whole steps: stoker.fit against a hand loop making the same calls
and the same non-finite check (``hand_checked``). This splits the step at the loop's own
phase boundaries (``stoker.observe.timing``): fetch (the loader's ``next``), forward
(the batch split, forward and loss), backward, and the rest (check, optimizer, the
loop's records, up to the next fetch). Contenders, on the seed workload (``trainer.py``'s
MLP, fused Adam, batch 64, one thread):

- ``hand``: ``hand_checked``'s calls in a hand loop, its clock read at the same four
  points and handed over as ``PhaseTimer.record`` is;
- ``stoker``: ``stoker.fit`` as it is, its own readings;
- ``stoker_hand_calls``: ``stoker.fit`` with its step replaced by the hand loop's calls
  in the hand loop's order (``model(x)``, ``nn.CrossEntropyLoss``, ``zero_grad``,
  ``backward``, the check, ``step``) and the same readings: what the loop around the
  step costs, and whether the same calls run as fast inside it.

Contenders alternate round by round after a warm-up round; each round's median per
phase, then the median over rounds (steps followed by a record or an epoch end are left
out: a gap over 10 ms).

    python benchmarks/step_phases.py --rounds 11
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer
from common import interleaved, seed_model

import stoker
from stoker.examples.datasets import seed_tabular
from stoker.train import loop as loop_module
from stoker.train.grads import FiniteCheck
from stoker.train.optim_calls import OptimizerCalls
from stoker.train.precision import Precision

PHASES = ("fetch", "forward", "backward", "rest")
_END = loop_module._END
Readings = list[tuple[float, ...]]


def hand(arrays: Any, epochs: int) -> Readings:
    """``hand_checked``'s loop, read at the loop's phase boundaries."""
    model = seed_model()
    loader = stoker.build_loader(arrays, batch_size=trainer.BATCH, shuffle=True, seed=0)
    optimizer = trainer.adam(True)(model.parameters())
    calls = OptimizerCalls(optimizer, Precision("fp32", torch.device("cpu")))
    check, loss_fn, now = (
        FiniteCheck(list(model.parameters())),
        nn.CrossEntropyLoss(),
        time.perf_counter,
    )
    readings: Readings = []
    record = readings.append
    for _ in range(epochs):
        batches = iter(loader)
        while True:
            fetching = now()
            batch = next(batches, _END)
            fetched = now()
            if batch is _END:
                break
            xb, yb = batch
            loss = loss_fn(model(xb), yb)
            forwarded = now()
            calls.zero_grad()
            loss.backward()
            record((fetching, fetched, fetched, forwarded, now()))
            if check(loss) != (True, True):
                raise FloatingPointError("non-finite loss or gradient")
            calls.step()
    return readings


def hand_calls_step(loop: Any, metrics: Any) -> Callable[[Iterator[Any], Any], int]:
    """A ``plain_step`` that makes the hand loop's calls, in its order."""
    model, now, record = loop.model, loop.timer.now, loop.timer.record
    loss_fn, check, calls = nn.CrossEntropyLoss(), loop.finite_check(), loop.optimizer_calls
    state = loop.state

    def step(batches: Iterator[Any], window: Any) -> int:
        fetching = now()
        batch = next(batches, _END)
        fetched = now()
        if batch is _END:
            loop.timer.close_step(fetching)
            return 0
        xb, yb = batch
        outputs = model(xb)
        loop.kept_graph = loss = loss_fn(outputs, yb)
        forwarded = now()
        calls.zero_grad()
        loss.backward()
        record((fetching, fetched, fetched, forwarded, now()))
        if check(loss) != (True, True):
            raise FloatingPointError("non-finite loss or gradient")
        calls.step()
        metrics.update(outputs, yb, check.loss_value, len(yb))  # the epoch record needs it
        state.step += 1
        window.steps += 1
        return 1

    return step


def fit(arrays: Any, epochs: int, root: Path, *, hand_calls: bool) -> Readings:
    """``stoker.fit``, its timer's readings captured as they are recorded."""
    readings: Readings = []
    real_plain = loop_module.plain_step

    teed: list[Any] = []  # the timer whose record is teed (plain_step is built each epoch)

    def capturing(loop: Any, metrics: Any) -> Any:
        if loop.timer not in teed:
            own = loop.timer.record

            def tee(reading: tuple[float, ...]) -> None:
                own(reading)
                readings.append(reading)

            loop.timer.record = tee
            teed.append(loop.timer)
        return (hand_calls_step if hand_calls else real_plain)(loop, metrics)

    loop_module.plain_step = capturing
    try:
        trainer.stoker_fit(seed_model(), arrays, epochs, root)
    finally:
        loop_module.plain_step = real_plain
    return readings


def phase_medians(readings: Readings) -> dict[str, float]:
    """Median seconds per phase; a step's rest runs to the next step's fetch."""
    spans: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for step, following in itertools.pairwise(readings):
        if following[0] - step[0] > 0.01:  # a record, an epoch end: not a plain step
            continue
        fetching, fetched, _, forwarded, backwarded = step
        spans["fetch"].append(fetched - fetching)
        spans["forward"].append(forwarded - fetched)
        spans["backward"].append(backwarded - forwarded)
        spans["rest"].append(following[0] - backwarded)
    return {phase: statistics.median(values) for phase, values in spans.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    arrays = seed_tabular()
    root = Path(tempfile.mkdtemp(prefix="stoker-step-phases-"))
    runs: dict[str, Callable[[], dict[str, float]]] = {
        "hand": lambda: phase_medians(hand(arrays, args.epochs)),
        "stoker": lambda: phase_medians(fit(arrays, args.epochs, root, hand_calls=False)),
        "stoker_hand_calls": lambda: phase_medians(fit(arrays, args.epochs, root, hand_calls=True)),
    }
    results = interleaved(runs, rounds=args.rounds)
    print(f"{args.rounds} rounds of {args.epochs} epochs; medians, µs")
    print(f"{'':18s}" + "".join(f"{name:>10s}" for name in (*PHASES, "step")))
    base = {phase: statistics.median(r[phase] for r in results["hand"]) for phase in PHASES}
    for name, rounds in results.items():
        row = {phase: statistics.median(r[phase] for r in rounds) for phase in PHASES}
        print(f"{name:18s}" + "".join(f"{row[p] * 1e6:10.1f}" for p in PHASES)
              + f"{sum(row.values()) * 1e6:10.1f}")  # fmt: skip
        if name != "hand":
            gaps = [row[p] - base[p] for p in PHASES]
            print(f"{'  - hand':18s}" + "".join(f"{gap * 1e6:+10.1f}" for gap in gaps)
                  + f"{sum(gaps) * 1e6:+10.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
