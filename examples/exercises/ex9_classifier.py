"""Exercise 9 — An end-to-end classifier: custom Dataset, DataLoader, nn.Module,
CrossEntropyLoss, AdamW, autograd, GPU, validation loop and checkpointing, tracking
training and validation loss and accuracy and the epoch time.

``stoker.fit`` is the loop: it builds the DataLoaders, moves batches to the GPU when
there is one (``device="auto"``), runs forward, loss, backward and AdamW, validates
after every epoch under ``torch.inference_mode``, writes checkpoints (last, best by
``val/accuracy``, the newest ``keep_last``) and records every figure in
``result.history`` and ``metrics.jsonl``. The last part loads the newest checkpoint
(with ``weights_only=True``) into a fresh model and checks it predicts the same.

Run: python examples/exercises/ex9_classifier.py
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset

import stoker
from stoker.checkpoint import find_latest, load_checkpoint

TRACKED = ("train/loss", "val/loss", "train/accuracy", "val/accuracy", "time/epoch_s")


class Rings(Dataset):
    """Points on three noisy concentric rings; the class is the ring. Not linearly separable."""

    def __init__(self, n: int = 3000, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 3, (n,), generator=generator)
        radius = 1.0 + self.labels.float() + 0.25 * torch.randn(n, generator=generator)
        angle = 2 * math.pi * torch.rand(n, generator=generator)
        self.points = torch.stack([radius * angle.cos(), radius * angle.sin()], dim=1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[index], self.labels[index]


class Classifier(nn.Module):
    def __init__(self, hidden: int = 64, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # logits; CrossEntropyLoss applies the softmax


def main(
    train_size: int = 3000,
    val_size: int = 600,
    epochs: int = 12,
    runs_root: str | Path = "runs",
) -> dict[str, object]:
    """Returns the per-epoch history of the tracked figures and the checkpoint check."""
    torch.manual_seed(0)
    model = Classifier()
    result = stoker.fit(
        model,
        Rings(train_size, seed=0),
        Rings(val_size, seed=1),  # the validation set: its own samples
        epochs=epochs,
        batch_size=64,
        loss="cross_entropy",
        optimizer="adamw",
        lr=1e-2,
        weight_decay=1e-4,
        schedule="cosine",
        device="auto",  # cuda, then mps, then cpu
        monitor="val/accuracy",  # best.* and early stopping follow this metric
        keep_last=2,
        runs_root=str(runs_root),
        name="ex9-classifier",
        progress="plain",
    )
    print(f"\n{'epoch':>5} " + " ".join(f"{key:>14}" for key in TRACKED))
    for record in result.history:
        print(f"{record['epoch']:>5} " + " ".join(f"{record[k]:>14.4f}" for k in TRACKED))

    # Checkpointing: load the newest checkpoint into a fresh model, as a restart would.
    checkpoint = find_latest(result.run_dir)
    assert checkpoint is not None
    state = load_checkpoint(checkpoint)  # torch.load(weights_only=True): no pickled code
    restored = Classifier()
    restored.load_state_dict(state["model"])
    probe = Rings(256, seed=2).points
    with torch.inference_mode():
        trained = result.model.cpu()(probe)
        same = torch.allclose(restored(probe), trained, atol=1e-6)
    print(f"best val/accuracy {result.best_value:.4f} at epoch {result.best_epoch}")
    print(f"checkpoint {checkpoint.relative_to(result.run_dir)} restores the model: {same}")
    return {
        "history": [{key: record[key] for key in TRACKED} for record in result.history],
        "best_val_accuracy": result.best_value,
        "checkpoint_restores": same,
        "run_dir": str(result.run_dir),
    }


if __name__ == "__main__":
    main()
