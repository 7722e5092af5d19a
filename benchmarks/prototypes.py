"""What each proposed change to stoker would buy: prototypes applied by monkeypatching.

Not part of ``make bench``'s pass/fail: the figures there use stoker as it is. This
script measures, on the trainer-overhead workload of ``trainer.py`` (seed data, MLP
20→32→2, fused Adam, batch 64, stoker's own loader), the median step time of
``stoker.fit`` as it is, with each change alone, and with all of them together —
interleaved round by round with the hand-written loop — and the loader's throughput
with a leaner ``ArrayDataset.__getitems__``. A change that no longer applies (the code
it patches has moved) is reported as such, not measured.

    python benchmarks/prototypes.py --out bench-out
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import itertools
import math
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer
from common import (
    Result,
    Timed,
    add_common_arguments,
    info,
    interleaved,
    median,
    paired_ratio,
    seed_model,
    set_threads,
    table,
    weights_of,
)
from trainer import BATCH, adam, hand_loop, stoker_fit

import stoker
from stoker.data import sources
from stoker.examples.datasets import seed_tabular
from stoker.observe import timing
from stoker.train import grads, loop, metrics, precision, session

Undo = list[tuple[Any, str, Any]]


def setattr_(undo: Undo, obj: Any, name: str, value: Any) -> None:
    undo.append((obj, name, getattr(obj, name)))
    setattr(obj, name, value)


# ------------------------------------------------------------------ the changes
#
# A change is a monkeypatch, edits of train_step's source (old line -> new lines), or
# both. The edits of all the changes applied together go into one recompiled train_step.

Edits = tuple[tuple[str, str], ...]


def norm_only_when_clipping(undo: Undo) -> None:
    """GradClipper.clip_: no total-norm kernels on a step that clips nothing."""
    original = grads.GradClipper.clip_

    def clip_(self, parameters):
        if self.max_norm is None and self.max_value is None:
            return None
        return original(self, parameters)

    setattr_(undo, grads.GradClipper, "clip_", clip_)


NORM_EDITS: Edits = (
    (
        "window.grad_norm += grad_norm.detach().float().to(loop.device)",
        "if grad_norm is not None:\n"
        "        window.grad_norm += grad_norm.detach().float().to(loop.device)",
    ),
    (
        "_halt_on_nonfinite(loop, step_loss, grad_norm)",
        "_halt_on_nonfinite(loop, step_loss, torch.zeros(()) if grad_norm is None else grad_norm)",
    ),
)


def finite_check_on_loss(undo: Undo) -> None:
    """_halt_on_nonfinite: read one flag (the loss) instead of stacking loss and norm."""
    original = loop._halt_on_nonfinite

    def check(run, step_loss, grad_norm):
        if not math.isfinite(step_loss.item()):  # on CUDA: read a step late (see docs)
            original(run, step_loss, grad_norm)

    setattr_(undo, loop, "_halt_on_nonfinite", check)


def loss_only_metrics(undo: Undo) -> None:
    """TaskMetrics.update: the loss sum only (train accuracy off), one in-place add."""
    original = metrics.TaskMetrics.update

    def update(self, outputs, targets, loss, count):
        if self._loss_sum.device != loss.device:
            return original(self, outputs, targets, loss, count)
        self._loss_sum.add_(loss.detach(), alpha=count)
        self.samples += count
        return None

    setattr_(undo, metrics.TaskMetrics, "update", update)


class ConstantLR:
    """A scheduler that is a no-op object for a constant schedule (lr never moves)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer
        self.last_epoch = 0

    def step(self) -> None:
        self.last_epoch += 1

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = state["last_epoch"]


def null_constant_schedule(undo: Undo) -> None:
    original = session.build_scheduler

    def build(optimizer, config, *, total_steps):
        if config.name == "constant" and config.warmup_steps == 0:
            return ConstantLR(optimizer)
        return original(optimizer, config, total_steps=total_steps)

    setattr_(undo, session, "build_scheduler", build)


def cpu_move_passthrough(undo: Undo) -> None:
    """move_to_device: nothing to walk when the device is the CPU and the batch a CPU tuple."""
    original = loop.move_to_device

    def move(batch, device, *, non_blocking=True):
        if device.type == "cpu" and type(batch) is tuple and all(t.is_cpu for t in batch):
            return batch
        return original(batch, device, non_blocking=non_blocking)

    setattr_(undo, loop, "move_to_device", move)


_NULL_CONTEXT = contextlib.nullcontext()


def fp32_null_autocast(undo: Undo) -> None:
    """Precision.autocast: a shared nullcontext in fp32, not a generator context manager."""
    original = precision.Precision.autocast

    def autocast(self):
        return _NULL_CONTEXT if self.dtype is None else original(self)

    setattr_(undo, precision.Precision, "autocast", autocast)


class RawStampTimer(timing.PhaseTimer):
    """PhaseTimer (CPU) that appends one float per phase boundary and nothing else.

    A step's start is stored negated (``perf_counter`` is positive), so steps can be
    told apart; the phases follow from the order the loop calls them in: data wait,
    then (transfer, forward, backward) per micro-batch, then optimizer. Durations are
    worked out when ``summary`` is read (once per epoch), not per step.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._marks: list[float] = []
        self._mark = self._marks.append

    def start_step(self) -> None:
        self._mark(-time.perf_counter())

    def data_ready(self) -> None:
        self._mark(time.perf_counter())

    def lap(self, phase: str) -> None:
        self._mark(time.perf_counter())

    def end_step(self) -> None:
        pass

    def _resolve_pending(self) -> None:
        super()._resolve_pending()
        marks, self._marks[:] = list(self._marks), []
        starts = [i for i, mark in enumerate(marks) if mark < 0] + [len(marks)]
        for begin, end in itertools.pairwise(starts):
            times = [-marks[begin], *marks[begin + 1 : end]]
            laps = [b - a for a, b in itertools.pairwise(times)]
            step = [0.0] * len(timing.PHASES)
            step[0] = laps[0]  # data wait
            for k, lap in enumerate(laps[1:-1]):  # transfer, forward, backward per micro-batch
                step[1 + k % 3] += lap
            step[4] = laps[-1]  # optimizer
            self._steps.append(step)


def raw_stamp_timer(undo: Undo) -> None:
    def build(device: torch.device) -> timing.PhaseTimer:
        return RawStampTimer(device) if device.type == "cpu" else timing.PhaseTimer(device)

    setattr_(undo, session, "PhaseTimer", build)


#: Skip multiplying the loss by 1.0 (and its backward node) and the zeros tensor per step.
UNIT_WEIGHT_EDITS: Edits = (
    ("step_loss = torch.zeros((), device=loop.device)", "step_loss = None"),
    (
        "loop.precision.backward(loss * (size / step_count))",
        "loop.precision.backward(loss if size == step_count else loss * (size / step_count))",
    ),
    (
        "step_loss += loss.detach().float() * (size / step_count)",
        "part = loss.detach().float()\n"
        "        part = part if size == step_count else part * (size / step_count)\n"
        "        step_loss = part if step_loss is None else step_loss + part",
    ),
)

#: name: (monkeypatch or None, train_step edits)
CHANGES: dict[str, tuple[Callable[[Undo], None] | None, Edits]] = {
    "grad norm only when clipping": (norm_only_when_clipping, NORM_EDITS),
    "finite check on the loss only": (finite_check_on_loss, ()),
    "loss-only TaskMetrics (no train accuracy)": (loss_only_metrics, ()),
    "no-op scheduler for constant lr": (null_constant_schedule, ()),
    "move_to_device pass-through on CPU": (cpu_move_passthrough, ()),
    "nullcontext autocast in fp32": (fp32_null_autocast, ()),
    "no loss*1.0 without accumulation": (None, UNIT_WEIGHT_EDITS),
    "raw-stamp PhaseTimer": (raw_stamp_timer, ()),
}


def apply(names: list[str], undo: Undo) -> None:
    """Apply the named changes (their monkeypatches, then all their edits at once)."""
    edits: list[tuple[str, str]] = []
    for name in names:
        patch, more = CHANGES[name]
        if patch is not None:
            patch(undo)
        edits.extend(more)
    if not edits:
        return
    source = textwrap.dedent(inspect.getsource(loop.train_step))
    for old, new in edits:
        if source.count(old) != 1:
            raise LookupError(f"train_step no longer contains {old!r}")
        source = source.replace(old, new)
    namespace: dict[str, Any] = {}
    exec(compile(source, loop.__file__, "exec"), loop.__dict__, namespace)
    setattr_(undo, loop, "train_step", namespace["train_step"])


def lean_getitems(self, indices):
    """ArrayDataset.__getitems__ without as_tensor on an int64 tensor and a generator."""
    if type(indices) is torch.Tensor and indices.dtype is torch.int64:
        idx = indices
    else:
        idx = torch.as_tensor(indices, dtype=torch.long)
    if self._on_cpu:
        return tuple([t.index_select(0, idx) for t in self._arrays])
    return tuple([t.index_select(0, idx.to(t.device)) for t in self._arrays])


def patched(names: list[str], run: Callable[[], Any]) -> Callable[[], Any]:
    def call() -> Any:
        undo: Undo = []
        try:
            apply(names, undo)
            return run()
        finally:
            for obj, name, value in reversed(undo):
                setattr(obj, name, value)

    return call


def applicable(name: str) -> str | None:
    undo: Undo = []
    try:
        apply([name], undo)
    except LookupError as error:
        return str(error)
    finally:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    set_threads(args.threads)
    rounds = args.rounds or 7
    bench = "prototypes"
    arrays = seed_tabular()
    steps_per_epoch = -(-len(arrays) // BATCH)
    init = weights_of(seed_model())
    checks = []
    figures: dict[str, Any] = {}

    usable = []
    for name in CHANGES:
        problem = applicable(name)
        if problem:
            checks.append(info(bench, f"{name}", None, note=problem))
        else:
            usable.append(name)

    with tempfile.TemporaryDirectory(prefix="stoker-proto-") as tmp:
        root = Path(tmp)

        def loader():
            return stoker.build_loader(arrays, batch_size=BATCH, shuffle=True, seed=0)

        contenders: dict[str, Callable[[], Any]] = {
            "hand": Timed(
                init, steps_per_epoch, lambda m: hand_loop(m, loader(), args.epochs, adam(True))
            ),
            "stoker": Timed(
                init, steps_per_epoch, lambda m: stoker_fit(m, arrays, args.epochs, root)
            ),
        }
        for name in usable:
            contenders[name] = patched(
                [name],
                Timed(init, steps_per_epoch, lambda m: stoker_fit(m, arrays, args.epochs, root)),
            )
        lean = Timed(init, steps_per_epoch, lambda m: stoker_fit(m, arrays, args.epochs, root))
        contenders["all of the above"] = patched(usable, lean)
        print(f"{rounds} rounds of {args.epochs} epochs: {', '.join(contenders)}", flush=True)
        records = interleaved(contenders, rounds=rounds)
        hand = [r["step_s"] for r in records["hand"]]
        base = [r["step_s"] for r in records["stoker"]]
        checks.append(info(bench, "hand loop median step", median(hand) * 1e6, unit="us"))
        for name, values in records.items():
            if name == "hand":
                continue
            steps = [r["step_s"] for r in values]
            checks.append(
                info(
                    bench,
                    f"fit, {name}: step / hand",
                    paired_ratio(steps, hand),
                    unit="x",
                    note=f"{(median(base) - median(steps)) * 1e6:.1f} us/step less than as is",
                )
            )
        figures["steps"] = {name: [r["step_s"] for r in values] for name, values in records.items()}
        lean_weights = lean.last_weights
        hand_weights = contenders["hand"].last_weights  # type: ignore[attr-defined]
        same = all(torch.equal(lean_weights[k], hand_weights[k]) for k in hand_weights)
        checks.append(info(bench, "all changes: final weights equal to hand", float(same), unit=""))

        # End to end (trainer.py's second part) with every change and the leaner fetch;
        # the seed loop, Lightning and the floor use no stoker code, so stay as they are.
        print("end to end with all the changes:", flush=True)
        if trainer.lightning_available():
            trainer.quiet_lightning()
        undo: Undo = []
        apply(usable, undo)
        setattr_(undo, sources.ArrayDataset, "__getitems__", lean_getitems)
        try:
            e2e, e2e_checks = trainer.end_to_end(
                root, rounds, 5, "" if trainer.lightning_available() else "not installed"
            )
        finally:
            for obj, attr, value in reversed(undo):
                setattr(obj, attr, value)
        for check in e2e_checks:
            check.benchmark = bench
            check.figure = check.figure.replace("e2e:", "e2e, all changes:")
        checks.extend(c for c in e2e_checks if c.target or "median step" in c.figure)
        figures["end_to_end_all_changes"] = e2e

    # The phase timer alone, in the bare loop, every other step timed (instrumentation.py).
    import instrumentation

    costs = {}
    for name, cls in (("PhaseTimer as is", timing.PhaseTimer), ("raw-stamp", RawStampTimer)):
        undo: Undo = []
        setattr_(undo, instrumentation, "PhaseTimer", cls)
        try:
            instrumentation.alternating_epochs(1)
            timed, untimed = instrumentation.alternating_epochs(20)
        finally:
            for obj, attr, value in reversed(undo):
                setattr(obj, attr, value)
        costs[name] = (median(timed) / median(untimed) - 1) * 100
        checks.append(info(bench, f"phase timing in the loop, {name}", costs[name], unit="%"))
    figures["phase_timer_pct"] = costs

    # The loader: stoker's direct path with the leaner __getitems__, against the gather.
    features, labels = arrays.arrays
    generator = torch.Generator().manual_seed(0)

    def gather() -> float:
        started = time.perf_counter()
        for _ in range(20):
            for idx in torch.randperm(len(features), generator=generator).split(BATCH):
                features.index_select(0, idx)
                labels.index_select(0, idx)
        return 20 * len(features) / (time.perf_counter() - started)

    def epochs_of(batches) -> Callable[[], float]:
        def run() -> float:
            started = time.perf_counter()
            for _ in range(20):
                for _batch in batches:
                    pass
            return 20 * len(features) / (time.perf_counter() - started)

        return run

    loader = stoker.build_loader(arrays, batch_size=BATCH, shuffle=True)

    def lean_loader() -> float:
        undo: Undo = []
        setattr_(undo, sources.ArrayDataset, "__getitems__", lean_getitems)
        try:
            return epochs_of(loader)()
        finally:
            for obj, name, value in reversed(undo):
                setattr(obj, name, value)

    rates = interleaved(
        {"gather": gather, "stoker": epochs_of(loader), "lean __getitems__": lean_loader},
        rounds=rounds,
    )
    for name in ("stoker", "lean __getitems__"):
        checks.append(
            info(
                bench,
                f"loader b{BATCH} w=0, {name}: / gather",
                paired_ratio(rates[name], rates["gather"]),
                unit="x",
            )
        )
    figures["loader_rates"] = rates
    print(table(checks))
    for check in checks:
        if check.note:
            print(f"  {check.figure}: {check.note}")
    result = Result(
        benchmark="prototypes",
        timed="as trainer.py (overhead) and loader.py (batch 64, 0 workers)",
        workload={"epochs": args.epochs, "rounds": rounds, "threads": args.threads},
        figures=figures,
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
