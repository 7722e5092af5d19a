"""Exercise 3 — Custom Dataset: 1000 samples, 10 features, 1 target; ``len`` and ``dataset[0]``.

A map-style Dataset needs only ``__len__`` and ``__getitem__``. ``stoker.ArrayDataset``
is the same thing for data already in arrays, plus ``__getitems__``: it fetches a whole
batch with one index operation per field, so a stoker loader does no per-sample work.

Run: python examples/exercises/ex3_dataset.py
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

import stoker


class RegressionDataset(Dataset):
    """``n`` samples of ``features`` Gaussian values; the target is their sum, shape [1]."""

    def __init__(self, n: int = 1000, features: int = 10, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, features, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index], self.y[index]


def main(n: int = 1000, features: int = 10) -> dict[str, object]:
    """Returns the length and the sample and batch shapes of both datasets."""
    dataset = RegressionDataset(n, features)
    x0, y0 = dataset[0]
    print(f"len(dataset) = {len(dataset)}")
    print(f"dataset[0]   = (x {list(x0.shape)}, y {list(y0.shape)})  y = {y0.item():.4f}")

    arrays = stoker.ArrayDataset(dataset.x, dataset.y, names=["features", "target"])
    ax0, ay0 = arrays[0]
    xb, yb = arrays.__getitems__([0, 1, 2])  # one gather per field, not three lookups
    same = torch.equal(ax0, x0) and torch.equal(ay0, y0)
    print(f"stoker.ArrayDataset: len {len(arrays)}, sample 0 equal: {same}")
    print(f"  __getitems__([0, 1, 2]) -> x {list(xb.shape)}, y {list(yb.shape)}")
    return {
        "len": len(dataset),
        "x_shape": list(x0.shape),
        "y_shape": list(y0.shape),
        "array_len": len(arrays),
        "array_same": same,
        "batch_shapes": [list(xb.shape), list(yb.shape)],
    }


if __name__ == "__main__":
    main()
