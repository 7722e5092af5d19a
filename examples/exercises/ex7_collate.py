"""Exercise 7 — A custom ``collate_fn`` that pads [1, 2, 3], [4, 5], [6, 7, 8, 9] into one batch.

First by hand (``pad_sequence`` and a mask), then with ``stoker.data.pad_collate``,
which does the same and more (left padding, ``max_length``, ``pad_to_multiple_of``,
labels padded with -100 so the loss ignores them) — and in a loader, as
``collate_fn=pad_collate`` (or ``loader.collate_fn: pad`` in a run config).

Run: python examples/exercises/ex7_collate.py
"""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import Dataset

import stoker
from stoker.data import pad_collate

SEQUENCES = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def my_collate(samples: list[list[int]]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence with 0; the mask is 1 on real tokens, 0 on padding."""
    tensors = [torch.tensor(s) for s in samples]
    input_ids = pad_sequence(tensors, batch_first=True, padding_value=0)
    lengths = torch.tensor([len(s) for s in samples])
    attention_mask = (torch.arange(input_ids.shape[1]) < lengths[:, None]).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class Sequences(Dataset):
    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> list[int]:
        return self.sequences[index]


def main(sequences: list[list[int]] | None = None) -> dict[str, object]:
    """Returns the padded ids, the mask and their shape, from pad_collate in a loader."""
    sequences = sequences or SEQUENCES
    mine = my_collate(sequences)
    print("by hand:")
    print(f"  input_ids      {mine['input_ids'].tolist()}")
    print(f"  attention_mask {mine['attention_mask'].tolist()}")

    theirs = pad_collate(sequences)
    same = all(torch.equal(mine[key], theirs[key]) for key in mine)
    print(f"stoker.data.pad_collate gives the same batch: {same}")

    loader = stoker.build_loader(
        Sequences(sequences), batch_size=len(sequences), collate_fn=pad_collate
    )
    batch = next(iter(loader))
    shape = list(batch["input_ids"].shape)
    print(f"in a loader: input_ids {shape}, attention_mask {list(batch['attention_mask'].shape)}")
    print(f"  {batch['input_ids'].tolist()}")
    print(f"  {batch['attention_mask'].tolist()}")
    return {
        "shape": shape,
        "input_ids": batch["input_ids"].tolist(),
        "attention_mask": batch["attention_mask"].tolist(),
        "same_as_by_hand": same,
    }


if __name__ == "__main__":
    main()
