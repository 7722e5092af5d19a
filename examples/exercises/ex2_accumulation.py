"""Exercise 2 — Gradient accumulation: two backward passes add up; ``x.grad.zero_()`` resets.

Part 1 is plain PyTorch (the exercise is about autograd). Part 2 shows why accumulation
is a feature: stoker's ``grad_accum_steps`` sums the gradients of several micro-batches
before one optimizer step, so 2 micro-batches of 16 take the same step as one batch
of 32 — the weights after training come out the same.

Run: python examples/exercises/ex2_accumulation.py
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import stoker


def _grads(x_value: float) -> dict[str, float]:
    x = torch.tensor(x_value, requires_grad=True)

    def backward() -> float:
        y = x**2  # dy/dx = 2x; a fresh graph each time (backward frees the old one)
        y.backward()
        assert x.grad is not None
        return x.grad.item()

    first = backward()
    second = backward()  # not cleared: PyTorch adds the new gradient to x.grad
    assert x.grad is not None
    x.grad.zero_()  # in place (trailing underscore): what optimizer.zero_grad() does
    after_zero = x.grad.item()
    after_zero_backward = backward()
    print(f"y = x², x = {x_value:g}: one backward -> x.grad = {first:g}")
    print(f"second backward without clearing  -> x.grad = {second:g}  (accumulated)")
    print(f"x.grad.zero_()                    -> x.grad = {after_zero:g}")
    print(f"backward again                    -> x.grad = {after_zero_backward:g}")
    return {
        "first": first,
        "second": second,
        "after_zero": after_zero,
        "after_zero_backward": after_zero_backward,
    }


def _train(features, labels, *, batch_size: int, accum: int, runs_root: Path) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    result = stoker.fit(
        model,
        (features, labels),
        epochs=1,
        batch_size=batch_size,
        grad_accum_steps=accum,
        shuffle=False,  # the same samples in the same order in both runs
        optimizer="sgd",
        momentum=0.0,
        lr=0.1,
        loss="mse",
        runs_root=str(runs_root),
        name=f"ex2-b{batch_size}x{accum}",
        progress="quiet",
    )
    return result.model


def main(samples: int = 256, runs_root: str | Path = "runs") -> dict[str, float]:
    """Returns the gradients of part 1 and the largest weight difference of part 2."""
    figures = _grads(5.0)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(samples, 8, generator=generator)
    labels = features.sum(dim=1, keepdim=True)
    one = _train(features, labels, batch_size=32, accum=1, runs_root=Path(runs_root))
    two = _train(features, labels, batch_size=16, accum=2, runs_root=Path(runs_root))
    difference = max(
        (a - b).abs().max().item() for a, b in zip(one.parameters(), two.parameters(), strict=True)
    )
    print(
        f"stoker.fit: batch 32 vs 2 accumulated micro-batches of 16, {samples // 32} steps: "
        f"largest weight difference {difference:.2e}"
    )
    return {**figures, "max_weight_difference": difference}


if __name__ == "__main__":
    main()
