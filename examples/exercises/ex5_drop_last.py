"""Exercise 5 — ``drop_last``: 100 samples in batches of 32.

``drop_last=False`` gives 32, 32, 32 and a short last batch of 4; ``drop_last=True``
drops it: three batches of 32, and 4 samples go unseen that epoch (with shuffling, a
different 4 each epoch).

Run: python examples/exercises/ex5_drop_last.py
"""

from __future__ import annotations

import torch

import stoker


def main(n: int = 100, batch_size: int = 32) -> dict[str, list[int]]:
    """Returns the batch sizes with and without ``drop_last``."""
    dataset = stoker.ArrayDataset(torch.arange(n, dtype=torch.float32).unsqueeze(1))
    figures = {}
    for drop_last in (False, True):
        loader = stoker.build_loader(dataset, batch_size=batch_size, drop_last=drop_last)
        sizes = [len(batch[0]) for batch in loader]
        print(f"drop_last={drop_last!s:<5}  {len(sizes)} batches, sizes {sizes}")
        figures[f"drop_last={drop_last}"] = sizes
    return figures


if __name__ == "__main__":
    main()
