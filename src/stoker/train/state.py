"""Training counters and the RNG states that an exact resume restores."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch


def epoch_number(epochs_done: int) -> int:
    """The number people read for the epoch after ``epochs_done`` finished ones.

    Epochs count from 1 wherever a user reads them: progress lines, messages, records
    (``FitResult.history``, ``metrics.jsonl``), checkpoints' ``epoch``, ``best_epoch``,
    ``summary.json`` and the report. The counter stays a count of finished epochs (the
    0-based index that ``set_epoch`` and the samplers take); this is the one conversion.
    """
    return epochs_done + 1


@dataclass
class TrainState:
    """Counters that survive a restart.

    ``epoch`` is the number of completed epochs (0 while the first one trains), so the
    epoch in progress is :attr:`epoch_number`; ``step`` the number of optimizer steps;
    ``micro_step`` the number of forward/backward passes. ``best_epoch`` is the number
    (from 1, as in the records) of the epoch with the best monitored value.
    """

    epoch: int = 0
    step: int = 0
    micro_step: int = 0
    samples_seen: int = 0
    best_value: float | None = None
    best_epoch: int | None = None
    epochs_without_improvement: int = 0

    @property
    def epoch_number(self) -> int:
        """The epoch being trained (or, until the loop counts it, just finished), from 1."""
        return epoch_number(self.epoch)

    def state_dict(self) -> dict[str, Any]:
        """The counters and the best metric, saved in every checkpoint."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved."""
        for key, value in state.items():
            setattr(self, key, value)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) so a run reproduces."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> dict[str, Any]:
    """Every global RNG, as tensors and plain data that ``weights_only`` loading accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back what ``capture_rng_state`` took."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state(
        (
            numpy_state["kind"],
            numpy_state["keys"].numpy().astype(np.uint32),
            numpy_state["pos"],
            numpy_state["has_gauss"],
            numpy_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
