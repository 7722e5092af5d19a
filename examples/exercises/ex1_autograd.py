"""Exercise 1 — Autograd: y = 3x³ + 2x² + x at x = 5, then y.backward() and x.grad.

Plain PyTorch: this exercise is about autograd itself. stoker adds one thing:
``stoker.observe.explain.explain`` prints the graph ``backward()`` walks, the same
view ``stoker explain CONFIG`` gives of a whole model's loss.

By hand: dy/dx = 9x² + 4x + 1 = 225 + 20 + 1 = 246 at x = 5.

Run: python examples/exercises/ex1_autograd.py
"""

from __future__ import annotations

import torch

from stoker.observe.explain import explain


def main(x_value: float = 5.0) -> dict[str, float]:
    """Compute y and dy/dx at ``x_value``; returns ``{"x", "y", "grad", "expected_grad"}``."""
    x = torch.tensor(x_value, requires_grad=True)  # a leaf: autograd records what uses it
    y = 3 * x**3 + 2 * x**2 + x

    # The graph backward() will walk, from y through each grad_fn to the leaf x.
    print(explain(y, params={"x": x}).to_text())

    y.backward()  # reverse-mode differentiation; the result lands in x.grad
    assert x.grad is not None
    expected = 9 * x_value**2 + 4 * x_value + 1
    print(f"x = {x_value:g}   y = {y.item():g}")
    print(f"x.grad = {x.grad.item():g}   (9x² + 4x + 1 = {expected:g})")
    print(f"x.is_leaf = {x.is_leaf}, y.is_leaf = {y.is_leaf}")
    print(f"y.grad_fn = {type(y.grad_fn).__name__}")
    return {"x": x_value, "y": y.item(), "grad": x.grad.item(), "expected_grad": expected}


if __name__ == "__main__":
    main()
