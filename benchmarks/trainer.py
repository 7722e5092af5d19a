"""Trainer overhead and end-to-end speed on the seed workload: stoker.fit vs hand-written loops.

Workload: the seed module's data (10,000 × 20 float32, binary label), its MLP 20→32→2,
Adam lr 1e-2, CrossEntropyLoss, batch 64, shuffled.

Timed: every contender's model carries the same forward pre-hook, which stamps
``perf_counter`` at each forward call. The time between two forward calls of an epoch
is one whole training step (fetch, forward, loss, backward, optimizer and whatever
bookkeeping the trainer does); "train time" is first to last forward, extrapolated by
one step, so it includes epoch boundaries but not start-up (config, run dir, data
fingerprint) or the end of the run (export, summary, report.html), which are reported
separately as wall time. Contenders alternate round by round after a warm-up round.

Overhead — the same model, initial weights, data, loader (``stoker.build_loader`` over
the same ArrayDataset, seed 0, so the same batches in the same order) and optimizer
(Adam, fused as stoker's ``fused: auto`` picks on CPU):

- ``hand``: the seed's loop body (zero_grad, backward, step);
- ``stoker``: ``stoker.fit`` (progress quiet, no TensorBoard, no checkpoints);
- ``lightning``: ``lightning.Trainer.fit`` (no logger, checkpoints, progress bar or
  model summary), skipped when lightning is not installed;
- ``hand_same``: the hand loop making exactly the public calls stoker's loop makes
  (``stoker.train.optim_calls``: ``optimizer.step()``, and every ``.grad`` set to None
  instead of ``zero_grad()``'s profiler range), so that stoker / hand_same is stoker's
  bookkeeping alone (the non-finite check, timing, metrics).
  Targets: stoker's median step time / hand_same's <= 1.03 (and / hand's), and
  bitwise-equal final weights.
- ``hand_checked``: ``hand_same`` plus stoker's non-finite check of the loss and every
  gradient before the step (``stoker.train.grads.FiniteCheck``, the calls
  ``train.on_nonfinite`` makes by default), so that stoker / hand_checked is the rest of
  the bookkeeping (timing, metrics, records) against a loop with the same guarantee.
  Target: <= 1.03 too.
- ``stoker_callback``: ``stoker.fit`` with one callback whose ``on_step_end`` does
  nothing, so that stoker_callback / stoker is what dispatching a step hook costs (a run
  with no callback makes one call to an empty function per step instead).

End to end (5 epochs):

- ``seed``: the seed's code — per-sample ``CSVWindowDataset`` through ``DataLoader``
  (batch 64, shuffle, num_workers 0: its fastest setting, see loader.py) and the
  default ``torch.optim.Adam``;
- ``stoker``: ``stoker.fit(model, (features, labels), optimizer="adam", lr=1e-2)``, all
  else stoker's defaults;
- ``lightning``: Trainer.fit on the seed's DataLoader and optimizer;
- ``floor``: the same model and optimizer as stoker's (fused Adam) fed pre-batched
  tensors from a list, with no loader and no bookkeeping; ``floor_direct`` the same
  with stoker's optimizer calls (shown, no target).
  Targets: train time seed / stoker >= 1.6, Lightning / stoker >= 2.5; median step
  time stoker / floor <= 1.10.

    python benchmarks/trainer.py --out bench-out
    python benchmarks/trainer.py --out bench-out --only overhead --no-lightning --rounds 9
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Check,
    CSVWindowDataset,
    Result,
    Timed,
    add_common_arguments,
    column,
    compare_weights,
    info,
    interleaved,
    lightning_available,
    lightning_fit,
    median,
    paired_ratio,
    quiet_lightning,
    seed_model,
    set_threads,
    spread,
    table,
    target_check,
    weights_of,
)

import stoker
from stoker.examples.datasets import seed_tabular
from stoker.train.grads import FiniteCheck
from stoker.train.optim_calls import OptimizerCalls
from stoker.train.precision import Precision

BATCH = 64
LR = 1e-2
OVERHEAD_MAX = 1.03
SEED_SPEEDUP_MIN = 1.6
LIGHTNING_SPEEDUP_MIN = 2.5
FLOOR_MAX = 1.10


def adam(fused: bool | None) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    """Adam lr 1e-2; ``fused=None`` is PyTorch's default (the seed's ``Adam(lr=1e-2)``)."""
    return lambda params: torch.optim.Adam(params, lr=LR, fused=fused)


# ------------------------------------------------------------------ the contenders


def optimizer_calls(
    optimizer: torch.optim.Optimizer, direct: bool
) -> tuple[Callable[[], object], Callable[[], None]]:
    """(step, zero_grad): the optimizer's own, or the calls ``stoker.fit``'s loop makes
    (``stoker.train.optim_calls``: the same public step, gradients set to None)."""
    if direct:
        calls = OptimizerCalls(optimizer, Precision("fp32", torch.device("cpu")))
        return calls.step, calls.zero_grad
    return optimizer.step, optimizer.zero_grad


def hand_loop(
    model: nn.Module,
    batches: Iterable,
    epochs: int,
    make_opt,
    *,
    direct: bool = False,
    checked: bool = False,
) -> float:
    """The seed's loop; returns the last loss. ``direct``: stoker's optimizer calls;
    ``checked``: also stoker's non-finite check of the loss and every gradient before
    the step (``FiniteCheck``: what ``train.on_nonfinite=halt`` needs), the same calls."""
    optimizer = make_opt(model.parameters())
    step, zero_grad = optimizer_calls(optimizer, direct)
    check = FiniteCheck(list(model.parameters())) if checked else None
    loss_fn = nn.CrossEntropyLoss()
    loss = torch.zeros(())
    for _ in range(epochs):
        for xb, yb in batches:
            logits = model(xb)
            loss = loss_fn(logits, yb)
            zero_grad()
            loss.backward()
            if check is not None and check(loss) != (True, True):
                raise FloatingPointError("non-finite loss or gradient")
            step()
    return float(loss.detach())


def floor_loop(
    model: nn.Module, epoch_batches: list[list[tuple]], make_opt, *, direct: bool = False
) -> float:
    """Pre-batched tensors, no loader, no bookkeeping (same update as hand_loop)."""
    optimizer = make_opt(model.parameters())
    step, zero_grad = optimizer_calls(optimizer, direct)
    loss_fn = nn.CrossEntropyLoss()
    loss = torch.zeros(())
    for batches in epoch_batches:
        for xb, yb in batches:
            loss = loss_fn(model(xb), yb)
            zero_grad()
            loss.backward()
            step()
    return float(loss.detach())


def stoker_fit(model: nn.Module, data: Any, epochs: int, root: Path, **options: Any) -> dict:
    result = stoker.fit(
        model,
        data,
        epochs=epochs,
        batch_size=BATCH,
        optimizer="adam",
        lr=LR,
        loss="cross_entropy",
        seed=0,
        threads=torch.get_num_threads(),  # the hand loops' count (--threads)
        progress="quiet",
        tensorboard=False,
        enabled=False,  # checkpoint.enabled
        run_dir=tempfile.mkdtemp(dir=root),
        **options,
    )
    steps = [r["time/step_s"] for r in result.history if "time/step_s" in r]
    return {"loss": result.metrics.get("train/loss"), "stoker_step_s": median(steps)}


class NoOpStepCallback:
    """A callback with an ``on_step_end`` that does nothing: the cost of the hook alone."""

    def on_step_end(self, loop: Any, step: Any) -> None:
        pass


def step_hook_dispatch_s() -> dict[str, float]:
    """Seconds per step of the loop's step hook alone (``Callbacks.step_end``), timed with
    timeit in this process: with no callback and with one no-op callback. The whole-run
    ratio below cannot resolve a cost this small on a shared machine; this can."""
    import functools
    import timeit
    from types import SimpleNamespace

    from stoker.train.callbacks import Callbacks

    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    state = SimpleNamespace(step=5, epoch=0, epoch_number=1)
    loop = SimpleNamespace(state=state, step_loss=torch.tensor(1.0), optimizer=optimizer)
    figures = {}
    for name, callbacks in (("none", Callbacks()), ("noop", Callbacks([NoOpStepCallback()]))):
        number = 100_000
        call = functools.partial(callbacks.step_end, loop, None, 3)
        best = min(timeit.repeat(call, number=number, repeat=5))
        figures[name] = best / number
    return figures


# ------------------------------------------------------------------ the two benchmarks


def overhead(root: Path, rounds: int, epochs: int, lightning: str) -> tuple[dict, list]:
    """``lightning``: "" to include it, else why it is left out."""
    use_lightning = not lightning
    bench = "trainer"
    arrays = seed_tabular()
    steps_per_epoch = -(-len(arrays) // BATCH)
    init = weights_of(seed_model())

    def stoker_loader():
        return stoker.build_loader(arrays, batch_size=BATCH, shuffle=True, seed=0)

    contenders: dict[str, Timed] = {
        "hand": Timed(
            init, steps_per_epoch, lambda m: hand_loop(m, stoker_loader(), epochs, adam(True))
        ),
        "stoker": Timed(init, steps_per_epoch, lambda m: stoker_fit(m, arrays, epochs, root)),
        "hand_same": Timed(
            init,
            steps_per_epoch,
            lambda m: hand_loop(m, stoker_loader(), epochs, adam(True), direct=True),
        ),
        "hand_checked": Timed(
            init,
            steps_per_epoch,
            lambda m: hand_loop(m, stoker_loader(), epochs, adam(True), direct=True, checked=True),
        ),
        "stoker_callback": Timed(
            init,
            steps_per_epoch,
            lambda m: stoker_fit(m, arrays, epochs, root, callbacks=[NoOpStepCallback()]),
        ),
    }
    if use_lightning:
        contenders["lightning"] = Timed(
            init, steps_per_epoch, lambda m: lightning_fit(m, stoker_loader(), epochs, adam(True))
        )
    print(f"overhead: {rounds} rounds of {epochs} epochs: {', '.join(contenders)}", flush=True)
    records = interleaved(contenders, rounds=rounds)  # type: ignore[arg-type]

    # Final weights after the same epochs: fused Adam in both, then the seed's default Adam.
    weights: dict[str, dict[str, Any]] = {}
    weights["stoker_vs_hand_fused"] = compare_weights(
        contenders["hand"].last_weights, contenders["stoker"].last_weights
    )
    unfused = {
        "hand": Timed(
            init, steps_per_epoch, lambda m: hand_loop(m, stoker_loader(), epochs, adam(None))
        ),
        "stoker": Timed(
            init, steps_per_epoch, lambda m: stoker_fit(m, arrays, epochs, root, fused=False)
        ),
    }
    for run in unfused.values():
        run()
    weights["stoker_vs_hand_unfused"] = compare_weights(
        unfused["hand"].last_weights, unfused["stoker"].last_weights
    )
    weights["stoker_fused_vs_unfused"] = compare_weights(
        contenders["stoker"].last_weights, unfused["stoker"].last_weights
    )
    if use_lightning:
        weights["lightning_vs_hand_fused"] = compare_weights(
            contenders["hand"].last_weights, contenders["lightning"].last_weights
        )

    dispatch = step_hook_dispatch_s()
    hand_steps = column(records["hand"], "step_s")
    ratio = paired_ratio(column(records["stoker"], "step_s"), hand_steps)
    same = weights["stoker_vs_hand_fused"]["bitwise_equal"]
    checks: list[Check] = [
        info(bench, "overhead: hand loop median step", median(hand_steps) * 1e6, unit="us"),
        info(
            bench,
            "overhead: stoker.fit median step",
            median(column(records["stoker"], "step_s")) * 1e6,
            unit="us",
        ),
        info(
            bench,
            "overhead: stoker's own time/step_s",
            median(column(records["stoker"], "stoker_step_s")) * 1e6,
            unit="us",
            note="stoker's PhaseTimer: fetch to optimizer, without the record at the end",
        ),
        target_check(bench, "overhead: stoker / hand step time", ratio, "<=", OVERHEAD_MAX),
        target_check(
            bench,
            "overhead: stoker / hand loop making the same public calls",
            paired_ratio(
                column(records["stoker"], "step_s"), column(records["hand_same"], "step_s")
            ),
            "<=",
            OVERHEAD_MAX,
            note="the bookkeeping alone: both call optimizer.step() and set grads to None",
        ),
        target_check(
            bench,
            "overhead: stoker / hand loop making the same calls and the non-finite check",
            paired_ratio(
                column(records["stoker"], "step_s"), column(records["hand_checked"], "step_s")
            ),
            "<=",
            OVERHEAD_MAX,
            note="like for like: both also check the loss and every gradient before the step",
        ),
        info(
            bench,
            "overhead: CPU time, stoker / hand loop making the same calls",
            paired_ratio(
                column(records["stoker"], "cpu_step_s"), column(records["hand_same"], "cpu_step_s")
            ),
            unit="x",
            note="median step in this process's CPU time (less disturbed by other jobs)",
        ),
        info(
            bench,
            "overhead: CPU time, stoker / hand loop with the non-finite check",
            paired_ratio(
                column(records["stoker"], "cpu_step_s"),
                column(records["hand_checked"], "cpu_step_s"),
            ),
            unit="x",
        ),
        info(
            bench,
            "overhead: train time (mean step, records and epoch ends included), "
            "stoker / hand loop making the same calls",
            paired_ratio(
                column(records["stoker"], "train_s"), column(records["hand_same"], "train_s")
            ),
            unit="x",
        ),
        info(
            bench,
            "overhead: hand loop with the non-finite check / without",
            paired_ratio(
                column(records["hand_checked"], "step_s"), column(records["hand_same"], "step_s")
            ),
            unit="x",
            note="what train.on_nonfinite's check costs a hand loop",
        ),
        info(
            bench,
            "overhead: stoker - hand per step",
            (median(column(records["stoker"], "step_s")) - median(hand_steps)) * 1e6,
            unit="us",
            note="fixed per-step cost: a smaller share of a longer step",
        ),
        info(
            bench,
            "overhead: stoker with a no-op on_step_end callback / stoker with none",
            paired_ratio(
                column(records["stoker_callback"], "step_s"), column(records["stoker"], "step_s")
            ),
            unit="x",
            note="the step hook's dispatch (a StepRecord per step); none registered: no record",
        ),
        info(
            bench,
            "overhead: step hook dispatch, no callback",
            dispatch["none"] * 1e9,
            unit="ns",
            note="timeit of Callbacks.step_end alone (through functools.partial), best of 5",
        ),
        info(
            bench,
            "overhead: step hook dispatch, one no-op callback",
            dispatch["noop"] * 1e9,
            unit="ns",
            note="a StepRecord and one call per step",
        ),
        Check(
            bench,
            "overhead: final weights equal with a callback",
            compare_weights(
                contenders["stoker"].last_weights, contenders["stoker_callback"].last_weights
            )["max_abs_diff"],
            "bitwise",
            compare_weights(
                contenders["stoker"].last_weights, contenders["stoker_callback"].last_weights
            )["bitwise_equal"],
            unit="max|diff|",
        ),
        Check(
            bench,
            "overhead: final weights equal (fused Adam both)",
            weights["stoker_vs_hand_fused"]["max_abs_diff"],
            "bitwise",
            same,
            unit="max|diff|",
        ),
        Check(
            bench,
            "overhead: final weights equal (fused=False vs seed's Adam)",
            weights["stoker_vs_hand_unfused"]["max_abs_diff"],
            "bitwise",
            weights["stoker_vs_hand_unfused"]["bitwise_equal"],
            unit="max|diff|",
        ),
        info(
            bench,
            "overhead: stoker fused vs unfused Adam weights",
            weights["stoker_fused_vs_unfused"]["max_abs_diff"],
            unit="max|diff|",
            note="different kernels, different rounding",
        ),
    ]
    if use_lightning:
        checks.append(
            info(
                bench,
                "overhead: lightning final weights equal to hand",
                float(weights["lightning_vs_hand_fused"]["bitwise_equal"]),
                unit="",
                note="1 = bitwise equal",
            )
        )
        checks.append(
            info(
                bench,
                "overhead: lightning / hand step time",
                paired_ratio(column(records["lightning"], "step_s"), hand_steps),
                unit="x",
            )
        )
    else:
        checks.append(Check(bench, "overhead: lightning / hand step time", None, status=lightning))
    figures = {
        "epochs": epochs,
        "rounds": records,
        "step_s": {k: spread(column(v, "step_s")) for k, v in records.items()},
        "weights": weights,
    }
    return figures, checks


def end_to_end(root: Path, rounds: int, epochs: int, lightning: str) -> tuple[dict, list]:
    use_lightning = not lightning
    bench = "trainer"
    per_sample = CSVWindowDataset()
    features, labels = per_sample.X, per_sample.y  # the same numpy arrays, given to stoker
    steps_per_epoch = -(-len(per_sample) // BATCH)
    init = weights_of(seed_model())

    def seed_loader() -> DataLoader:
        return DataLoader(per_sample, batch_size=BATCH, shuffle=True)

    tensors = torch.from_numpy(features), torch.from_numpy(labels)
    generator = torch.Generator().manual_seed(0)

    def floor_batches() -> list[list[tuple]]:
        out = []
        for _ in range(epochs):
            order = torch.randperm(len(features), generator=generator).split(BATCH)
            out.append([(tensors[0][i], tensors[1][i]) for i in order])
        return out

    def floor(model: nn.Module, *, direct: bool = False) -> float:
        batches = floor_batches()  # built before the first forward: outside train time
        return floor_loop(model, batches, adam(True), direct=direct)

    contenders: dict[str, Timed] = {
        "seed": Timed(
            init, steps_per_epoch, lambda m: hand_loop(m, seed_loader(), epochs, adam(None))
        ),
        "stoker": Timed(
            init, steps_per_epoch, lambda m: stoker_fit(m, (features, labels), epochs, root)
        ),
        "floor": Timed(init, steps_per_epoch, floor),
        "floor_direct": Timed(init, steps_per_epoch, lambda m: floor(m, direct=True)),
    }
    if use_lightning:
        contenders["lightning"] = Timed(
            init, steps_per_epoch, lambda m: lightning_fit(m, seed_loader(), epochs, adam(None))
        )
    print(f"end to end: {rounds} rounds of {epochs} epochs: {', '.join(contenders)}", flush=True)
    records = interleaved(contenders, rounds=rounds)  # type: ignore[arg-type]

    mine_train = column(records["stoker"], "train_s")
    mine_step = column(records["stoker"], "step_s")
    checks: list[Check] = []
    for name, values in records.items():
        checks.append(
            info(
                bench, f"e2e: {name} median step", median(column(values, "step_s")) * 1e6, unit="us"
            )
        )
    checks += [
        target_check(
            bench,
            "e2e: train time seed / stoker",
            paired_ratio(column(records["seed"], "train_s"), mine_train),
            ">=",
            SEED_SPEEDUP_MIN,
        ),
        info(
            bench,
            "e2e: wall time seed / stoker (incl. start-up, report)",
            paired_ratio(column(records["seed"], "wall_s"), column(records["stoker"], "wall_s")),
            unit="x",
        ),
    ]
    if use_lightning:
        checks.append(
            target_check(
                bench,
                "e2e: train time lightning / stoker",
                paired_ratio(column(records["lightning"], "train_s"), mine_train),
                ">=",
                LIGHTNING_SPEEDUP_MIN,
            )
        )
        checks.append(
            info(
                bench,
                "e2e: lightning / seed step time",
                paired_ratio(
                    column(records["lightning"], "step_s"), column(records["seed"], "step_s")
                ),
                unit="x",
            )
        )
    else:
        checks.append(Check(bench, "e2e: train time lightning / stoker", None, status=lightning))
    checks += [
        target_check(
            bench,
            "e2e: stoker / floor step time",
            paired_ratio(mine_step, column(records["floor"], "step_s")),
            "<=",
            FLOOR_MAX,
        ),
        info(
            bench,
            "e2e: stoker / floor with stoker's optimizer calls",
            paired_ratio(mine_step, column(records["floor_direct"], "step_s")),
            unit="x",
            note="the floor's update made as stoker makes it: loader and bookkeeping alone",
        ),
        info(
            bench,
            "e2e: stoker.fit outside the steps (start-up + end)",
            median([r["wall_s"] - r["train_s"] for r in records["stoker"]]),
            unit="s",
        ),
    ]
    figures = {
        "epochs": epochs,
        "rounds": records,
        "train_s": {k: spread(column(v, "train_s")) for k, v in records.items()},
        "step_s": {k: spread(column(v, "step_s")) for k, v in records.items()},
    }
    return figures, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--overhead-epochs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5, help="end-to-end epochs")
    parser.add_argument("--no-lightning", action="store_true", help="leave Lightning out")
    parser.add_argument(
        "--only",
        choices=("overhead", "end_to_end"),
        help="run one section (overhead: the per-step and callback figures, ~20 s)",
    )
    args = parser.parse_args()
    set_threads(args.threads)
    rounds = args.rounds or 9
    skip_lightning = ""
    if args.no_lightning:
        skip_lightning = "skipped"
    elif not lightning_available():
        skip_lightning = "not installed"
        print("lightning is not installed: its rows say so (pip install lightning to add them)")
    else:
        quiet_lightning()

    with tempfile.TemporaryDirectory(prefix="stoker-bench-") as tmp:
        root = Path(tmp)
        over_figures: dict = {}
        e2e_figures: dict = {}
        over_checks: list = []
        e2e_checks: list = []
        if args.only in (None, "overhead"):
            over_figures, over_checks = overhead(root, rounds, args.overhead_epochs, skip_lightning)
        if args.only in (None, "end_to_end"):
            e2e_figures, e2e_checks = end_to_end(root, rounds, args.epochs, skip_lightning)
    checks = over_checks + e2e_checks
    print(table(checks))
    lightning_version = None
    if not skip_lightning:
        import lightning

        lightning_version = lightning.__version__
    result = Result(
        benchmark="trainer",
        timed="per-step time = interval between consecutive forward calls within an epoch "
        "(a forward pre-hook on every contender's model); train time = first to last "
        "forward of the run, extrapolated by one step; wall = the whole call incl. start-up",
        workload={
            "data": "seed_tabular: 10,000 x 20 float32, binary label",
            "model": "MLP 20-32-2",
            "optimizer": "Adam lr 1e-2",
            "batch_size": BATCH,
            "rounds": rounds,
            "threads": args.threads,
            "lightning": lightning_version,
        },
        figures={"overhead": over_figures, "end_to_end": e2e_figures},
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
