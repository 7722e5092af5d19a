"""Exercise 4 — DataLoader(dataset, batch_size=32, shuffle=True): batch shape, count, last size.

1000 samples in batches of 32 make ceil(1000 / 32) = 32 batches; 31 full ones hold
992 samples, so the last holds 1000 - 992 = 8. ``stoker.build_loader`` gives the same
batches as ``torch.utils.data.DataLoader``, with shuffling seeded by (seed, epoch).

Run: python examples/exercises/ex4_dataloader.py
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import stoker


def main(n: int = 1000, features: int = 10, batch_size: int = 32) -> dict[str, object]:
    """Returns the first batch's shape, the number of batches and the last batch's size."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    y = torch.randint(0, 2, (n,), generator=generator)

    torch_loader = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True)
    torch_sizes = [len(xb) for xb, _ in torch_loader]

    loader = stoker.build_loader(stoker.ArrayDataset(x, y), batch_size=batch_size, shuffle=True)
    batches = list(loader)
    sizes = [len(xb) for xb, _ in batches]
    first_x, first_y = batches[0]
    print(f"batch shape:       x {list(first_x.shape)}, y {list(first_y.shape)}")
    print(f"number of batches: {len(batches)} (len(loader) = {len(loader)})")
    print(f"last batch size:   {sizes[-1]}")
    print(f"torch DataLoader:  {len(torch_sizes)} batches, last {torch_sizes[-1]}")
    return {
        "batch_shape": list(first_x.shape),
        "label_shape": list(first_y.shape),
        "num_batches": len(batches),
        "len_loader": len(loader),
        "last_batch_size": sizes[-1],
        "torch_num_batches": len(torch_sizes),
        "torch_last_batch_size": torch_sizes[-1],
    }


if __name__ == "__main__":
    main()
