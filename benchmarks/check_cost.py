"""What a non-finite check costs inside the seed step, in time rather than instructions.

``step_instructions.py`` counts the check at about 46,000 instructions of a 960,000 one
(under 5%), yet the trainer benchmark times stoker 8-11% slower than a hand loop without
it. This finds out why. ``stoker.fit`` runs the seed workload (``trainer.py``'s MLP,
fused Adam, batch 64) with its step replaced by the hand loop's calls (fetch, forward,
loss, backward, ``step``, ``zero_grad``, the metrics' update) plus one way of checking
the loss and gradients, timed around the check and forward to forward:

- ``none``: no check (the floor);
- ``loss``: the loss read to the host alone;
- ``stoker``: ``FiniteCheck`` as the loop makes it (gradients joined with ``cat`` after a
  ``ravel`` per matrix, one ``dot``, two reads);
- ``sums``: one ``sum`` per gradient, each read;
- ``norms``: one ``torch.linalg.vector_norm`` per gradient, each read;
- ``total_norm``: ``torch.nn.utils.get_total_norm``, read.

Contenders alternate round by round after a warm-up round; medians over the rounds of
each run's median step. ``--layers`` deepens the MLP (more gradient tensors).

    python benchmarks/check_cost.py --rounds 13
    python benchmarks/check_cost.py --rounds 9 --layers 7
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
import trainer
from common import StepStamps

from stoker.examples.datasets import seed_tabular
from stoker.train import loop as loop_module

Check = Callable[[Any, torch.Tensor], object]


def _grads(loop: Any) -> list[torch.Tensor]:
    return [p.grad for p in loop.parameters() if p.grad is not None]


def none(loop: Any, loss: torch.Tensor) -> object:
    return True


def loss_only(loop: Any, loss: torch.Tensor) -> object:
    return math.isfinite(loss.item())


def stoker_check(loop: Any, loss: torch.Tensor) -> object:
    return loop.finite_check()(loss)


def sums(loop: Any, loss: torch.Tensor) -> object:
    total = math.fsum(g.sum().item() for g in _grads(loop))
    return math.isfinite(total), math.isfinite(loss.item())


def norms(loop: Any, loss: torch.Tensor) -> object:
    squares = math.fsum(torch.linalg.vector_norm(g).item() ** 2 for g in _grads(loop))
    return math.isfinite(squares), math.isfinite(loss.item())


def total_norm(loop: Any, loss: torch.Tensor) -> object:
    norm = torch.nn.utils.get_total_norm(_grads(loop))
    return math.isfinite(norm.item()), math.isfinite(loss.item())


CHECKS: dict[str, Check] = {
    "none": none,
    "loss": loss_only,
    "stoker": stoker_check,
    "sums": sums,
    "norms": norms,
    "total_norm": total_norm,
}


def cut_down_step(check: Check, spent: list[float]) -> Callable[..., int]:
    """The loop's step reduced to the hand loop's calls plus ``check`` (timed into
    ``spent``); ``train_step`` is replaced by it, and ``plain_step`` serves no step."""
    end = loop_module._END

    def step(loop: Any, batches: Any, metrics: Any, window: Any) -> int:
        batch = next(batches, end)
        if batch is end:
            return 0
        inputs, targets = batch[0], batch[1]
        outputs = loop.model(inputs)
        loss = loop.loss_fn(outputs, targets)
        loss.backward()
        started = time.perf_counter()
        check(loop, loss)
        spent.append(time.perf_counter() - started)
        loop.optimizer_calls.step()
        loop.optimizer_calls.zero_grad()
        size = targets.shape[0]
        loop.state.step += 1
        window.steps += 1
        window.samples += size
        loop.step_loss = loss.data
        metrics.update(outputs, targets, loss.data, size)
        return 1

    return step


def deeper_model(layers: int) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        modules: list[nn.Module] = [nn.Linear(20, 32), nn.ReLU()]
        for _ in range(layers - 2):
            modules += [nn.Linear(32, 32), nn.ReLU()]
        return nn.Sequential(*modules, nn.Linear(32, 2))

    return build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2, help="Linear layers (2: the seed MLP)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    build = common.seed_model if args.layers == 2 else deeper_model(args.layers)
    arrays = seed_tabular()
    steps_per_epoch = -(-len(arrays) // trainer.BATCH)
    root = Path(tempfile.mkdtemp(prefix="stoker-check-cost-"))
    real_step, real_plain = loop_module.train_step, loop_module.plain_step
    step_s: dict[str, list[float]] = {name: [] for name in CHECKS}
    check_s: dict[str, list[float]] = {name: [] for name in CHECKS}
    for round_number in range(args.rounds + 1):  # round 0 warms up
        for name, check in CHECKS.items():
            spent: list[float] = []
            loop_module.train_step = cut_down_step(check, spent)
            loop_module.plain_step = lambda loop, metrics: None  # train_step makes each step
            model = build()
            stamps = StepStamps(model)
            try:
                trainer.stoker_fit(model, arrays, args.epochs, root)
            finally:
                loop_module.train_step, loop_module.plain_step = real_step, real_plain
                stamps.remove()
            if round_number:
                step_s[name].append(statistics.median(stamps.step_times(steps_per_epoch)))
                check_s[name].append(statistics.median(spent))
    floor = statistics.median(step_s["none"])
    print(f"{args.layers} Linear layers, {args.rounds} rounds of {args.epochs} epochs")
    print(f"{'check':12s} {'step us':>8s} {'+ us':>7s} {'/ none':>7s} {'check itself us':>16s}")
    for name in CHECKS:
        step = statistics.median(step_s[name])
        itself = statistics.median(check_s[name])
        print(
            f"{name:12s} {step * 1e6:8.1f} {(step - floor) * 1e6:7.1f} "
            f"{step / floor:7.3f} {itself * 1e6:16.2f}"
        )


if __name__ == "__main__":
    main()
