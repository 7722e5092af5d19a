"""Samplers seeded per (seed, epoch), independent of the global RNG: random, weighted, balanced."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from stoker.errors import ConfigError, DataError

__all__ = ["EpochRandomSampler", "EpochWeightedSampler", "balanced_weights", "epoch_seed"]

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def epoch_seed(seed: int, epoch: int, *, stream: int = 0) -> int:
    """A seed for one epoch, mixed from ``(seed, epoch, stream)`` with SplitMix64.

    Nearby inputs give unrelated seeds, so epoch 1 of seed 0 and epoch 0 of seed 1 do
    not share a permutation. ``stream`` separates independent uses of the same pair
    (the sampler's permutation vs the workers' seeds).

    Returns:
        A non-negative integer below 2**63, accepted by ``torch.Generator.manual_seed``.
    """
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ (epoch & _MASK64))
    x = _splitmix64(x ^ (stream & _MASK64))
    return x & ((1 << 63) - 1)


def _generator(seed: int, epoch: int) -> torch.Generator:
    return torch.Generator().manual_seed(epoch_seed(seed, epoch))


class EpochRandomSampler(Sampler[int]):
    """A random permutation per epoch, determined by ``(seed, epoch)`` alone.

    Unlike ``RandomSampler`` it never touches the global RNG, so a run resumed at
    epoch ``e`` sees exactly the order it would have seen. Call :meth:`set_epoch`
    before each epoch (``EpochLoader`` does).
    """

    def __init__(self, num_samples: int, *, seed: int = 0) -> None:
        """Build the sampler.

        Args:
            num_samples: Size of the dataset; indices run over ``range(num_samples)``.
            seed: Base seed, mixed with the epoch.
        """
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 0:
            raise DataError(
                f"EpochRandomSampler num_samples must be a non-negative int; got {num_samples!r}.",
                hint="pass len(dataset)",
            )
        self.num_samples = num_samples
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the permutation of ``epoch``."""
        self.epoch = int(epoch)

    def indices(self) -> torch.Tensor:
        """This epoch's order as one int64 tensor (what ``__iter__`` yields)."""
        return torch.randperm(self.num_samples, generator=_generator(self.seed, self.epoch))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        """What resumes this sampler: ``{"seed", "epoch"}``."""
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])


def _validate_weights(weights: Any, dataset_len: int | None) -> torch.Tensor:
    try:
        w = torch.as_tensor(
            np.asarray(weights) if not isinstance(weights, torch.Tensor) else weights
        )
        w = w.to(dtype=torch.float64, device="cpu")
    except (TypeError, ValueError, RuntimeError) as error:
        raise DataError(
            f"sampler weights of type {type(weights).__name__} do not convert to numbers.",
            hint="pass a 1-D tensor, numpy array or list of non-negative floats, one per sample",
        ) from error
    if w.dim() != 1:
        raise DataError(
            f"sampler weights have shape {tuple(w.shape)}; expected a 1-D array "
            "with one weight per sample.",
            hint="flatten the weights, e.g. weights.reshape(-1)",
        )
    if dataset_len is not None and w.numel() != dataset_len:
        raise DataError(
            f"sampler weights have {w.numel()} entries but the dataset has {dataset_len} "
            "samples; expected one weight per sample.",
            hint="compute the weights from the same dataset the loader reads",
        )
    if w.numel() == 0:
        raise DataError(
            "sampler weights are empty; expected one weight per sample.",
            hint="give a non-empty dataset and its weights",
        )
    bad = (~torch.isfinite(w)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise DataError(
            f"sampler weight at index {i} is {w[i].item()}; expected finite weights "
            f"({bad.numel()} non-finite in total).",
            hint="replace NaN/inf weights, e.g. torch.nan_to_num(weights, nan=0.0)",
        )
    negative = (w < 0).nonzero()
    if negative.numel():
        i = int(negative[0])
        raise DataError(
            f"sampler weight at index {i} is {w[i].item()}; expected non-negative weights "
            f"({negative.numel()} negative in total).",
            hint="weights are relative probabilities; use values >= 0",
        )
    if not bool((w > 0).any()):
        raise DataError(
            f"all {w.numel()} sampler weights are zero; expected at least one positive weight.",
            hint="give some samples a positive weight, or use loader.weights=balanced",
        )
    return w


class EpochWeightedSampler(Sampler[int]):
    """``WeightedRandomSampler`` whose draws are determined by ``(seed, epoch)`` alone."""

    def __init__(
        self,
        weights: torch.Tensor | np.ndarray | Sequence[float],
        *,
        num_samples: int | None = None,
        replacement: bool = True,
        seed: int = 0,
        dataset_len: int | None = None,
    ) -> None:
        """Build the sampler.

        Args:
            weights: One non-negative, finite weight per sample (need not sum to 1).
            num_samples: Draws per epoch; defaults to ``len(weights)``.
            replacement: Draw with replacement (the usual choice for class balancing).
            seed: Base seed, mixed with the epoch.
            dataset_len: Length of the dataset, checked against ``len(weights)``.

        Raises:
            DataError: Weights that are not 1-D, not finite, negative, all zero, or of
                the wrong length.
            ConfigError: ``num_samples`` below 1, or more draws without replacement
                than samples with positive weight.
        """
        self.weights = _validate_weights(weights, dataset_len)
        if num_samples is None:
            num_samples = self.weights.numel()
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ConfigError(
                f"loader.num_samples must be a positive int; got {num_samples!r}.",
                hint="set loader.num_samples to the draws per epoch, or leave it unset "
                "for one draw per sample",
            )
        positive = int((self.weights > 0).sum())
        if not replacement and num_samples > positive:
            raise ConfigError(
                f"loader.num_samples={num_samples} draws without replacement, but only "
                f"{positive} samples have a positive weight.",
                hint=f"set loader.num_samples<={positive}, or sample with replacement",
            )
        self.num_samples = num_samples
        self.replacement = replacement
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the draws of ``epoch``."""
        self.epoch = int(epoch)

    def indices(self) -> torch.Tensor:
        """This epoch's draws as one int64 tensor (what ``__iter__`` yields)."""
        return torch.multinomial(
            self.weights,
            self.num_samples,
            self.replacement,
            generator=_generator(self.seed, self.epoch),
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.num_samples

    def state_dict(self) -> dict[str, int]:
        """What resumes this sampler: ``{"seed", "epoch"}``."""
        return {"seed": self.seed, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])


def balanced_weights(targets: torch.Tensor | np.ndarray | Sequence[Any]) -> torch.Tensor:
    """Class-balanced sample weights: ``1 / count(class of the sample)``.

    With these weights every class is drawn equally often in expectation.

    Args:
        targets: One class label per sample.

    Returns:
        A float64 tensor with one weight per sample.

    Raises:
        DataError: The labels are not 1-D or are empty.
    """
    t = torch.as_tensor(targets if isinstance(targets, torch.Tensor) else np.asarray(targets))
    if t.dim() != 1:
        raise DataError(
            f"class labels have shape {tuple(t.shape)}; expected a 1-D array with one "
            "class id per sample.",
            hint="for one-hot labels pass labels.argmax(dim=1)",
        )
    if t.numel() == 0:
        raise DataError(
            "class labels are empty; expected one label per sample.",
            hint="check that the dataset is not empty",
        )
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise DataError(
            "class labels contain NaN or inf; expected class ids.",
            hint="clean the labels before computing balanced weights",
        )
    _, inverse, counts = torch.unique(t.cpu(), return_inverse=True, return_counts=True)
    weights = 1.0 / counts.to(torch.float64)
    return weights[inverse]
