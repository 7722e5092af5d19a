"""What a piece of per-step work costs inside a real training loop, by paired neighbours.

A piece that costs a microsecond in a tight ``timeit`` loop costs two to five inside a
training step, where the model's kernels have pushed its code and data out of the
caches; and the whole-run timings of two contenders drift apart on a shared machine
by more than the one percent being looked for. So the piece is measured where it
runs: the seed workload's bare loop (MLP 20→32→2, fused Adam, batch 64, pre-batched
tensors) runs every other step with the piece and the steps between without; which
steps carry it flips from epoch to epoch. Each step with the piece is compared with
the step before it and the step after it — neighbours a few hundred microseconds
apart share the machine's state — and the median of those differences over the
median plain step is the piece's cost. The same with a piece that does nothing reads
the method's bias (about ±0.1%).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from common import median, seed_model
from torch import nn

from stoker.examples.datasets import seed_tabular

BATCH = 64

#: One step with the piece: given the batches, it trains on the next one.
Step = Callable[[Iterator[Any]], None]


class Piece:
    """A contender: ``step`` trains one step with the piece; ``end_epoch`` runs after
    each epoch (what the loop does once per epoch, e.g. read the timer's summary)."""

    def __init__(self, step: Step, end_epoch: Callable[[], object] | None = None) -> None:
        self.step = step
        self.end_epoch = end_epoch or (lambda: None)


#: Builds a contender for a fresh model, optimizer and loss function.
PieceFactory = Callable[[nn.Module, torch.optim.Optimizer, nn.Module], Piece]


def plain_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: nn.Module
) -> Callable[[Iterator[Any]], torch.Tensor]:
    """The seed's loop body, on the next batch; returns the loss."""

    def step(batches: Iterator[Any]) -> torch.Tensor:
        xb, yb = next(batches)
        loss = loss_fn(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss

    return step


def alternating(epochs: int, make: PieceFactory) -> list[list[tuple[bool, float]]]:
    """Per epoch, every step in order: (with the piece, seconds from stamp to stamp)."""
    features, labels = seed_tabular().arrays
    generator = torch.Generator().manual_seed(0)
    model = seed_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)
    loss_fn = nn.CrossEntropyLoss()
    piece = make(model, optimizer, loss_fn)
    plain = plain_step(model, optimizer, loss_fn)
    clock = time.perf_counter
    runs: list[list[tuple[bool, float]]] = []
    for epoch in range(epochs):
        order = torch.randperm(len(features), generator=generator).split(BATCH)
        batches = [(features[i], labels[i]) for i in order]
        fetched = iter(batches)
        steps: list[tuple[bool, float]] = []
        last = clock()
        for index in range(len(batches)):
            on = index % 2 == epoch % 2
            if on:
                piece.step(fetched)
            else:
                plain(fetched)
            now = clock()
            steps.append((on, now - last))
            last = now
        piece.end_epoch()
        runs.append(steps)
    return runs


def paired_pct(runs: list[list[tuple[bool, float]]]) -> tuple[float, float]:
    """The piece's cost in % of a plain step, and the plain steps' median (s)."""
    differences: list[float] = []
    plain: list[float] = []
    for steps in runs:
        for index in range(1, len(steps) - 1):
            on, seconds = steps[index]
            if on:
                differences.append(seconds - steps[index - 1][1])
                differences.append(seconds - steps[index + 1][1])
            else:
                plain.append(seconds)
    step_s = median(plain)
    return median(differences) / step_s * 100, step_s


def measure(
    pieces: dict[str, PieceFactory], *, repeats: int, epochs: int
) -> tuple[dict[str, list[float]], float]:
    """Each piece's cost per repeat (%, the pieces run by turns), and the plain step (s)."""
    alternating(1, next(iter(pieces.values())))  # warm-up
    pcts: dict[str, list[float]] = {name: [] for name in pieces}
    step_s: list[float] = []
    names = list(pieces)
    for repeat in range(repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            pct, seconds = paired_pct(alternating(epochs, pieces[name]))
            pcts[name].append(pct)
            step_s.append(seconds)
    return pcts, median(step_s)
