"""One check shared by the tests: two nested states (tensors, dicts, lists) equal bit for bit."""

from __future__ import annotations

import torch


def assert_bitwise_equal(a, b, where: str = "") -> None:
    """Assert ``a`` equals ``b`` exactly, naming the first differing path on failure."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where
