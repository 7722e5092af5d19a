"""Weighted sampling seeded by (seed, epoch) alone, and class-balanced weights."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stoker.data.samplers import _RANK_STREAM, EpochOrderSampler, _generator, rank_slice
from stoker.data.sources import dataset_targets, innermost, origin_indices, origin_lengths
from stoker.errors import ConfigError, DataError

__all__ = ["EpochWeightedSampler", "balanced_weights", "weighted_sampler_for"]


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
            hint="give at least one sample a weight above 0",
        )
    return w


class EpochWeightedSampler(EpochOrderSampler):
    """``WeightedRandomSampler`` whose draws are determined by ``(seed, epoch)`` alone.

    Distributed, with replacement: each rank makes ``ceil(num_samples / world_size)``
    draws from its own random stream (rank 0 of one process draws what a single
    process would). Without replacement: every rank makes the same draw of
    ``num_samples`` and takes every ``world_size``-th, so no index repeats across
    ranks (but for the padding that evens out the last round).

    Mid-epoch resume works as for :class:`EpochRandomSampler`.
    """

    _resume_name = "EpochWeightedSampler"

    def __init__(
        self,
        weights: torch.Tensor | np.ndarray | Sequence[float],
        *,
        num_samples: int | None = None,
        replacement: bool = True,
        seed: int = 0,
        dataset_len: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """Build the sampler.

        Args:
            weights: One non-negative, finite weight per sample (need not sum to 1).
            num_samples: Draws per epoch over all ranks; defaults to ``len(weights)``.
            replacement: Draw with replacement (the usual choice for class balancing).
            seed: Base seed, mixed with the epoch (and, with replacement, the rank).
            dataset_len: Length of the dataset, checked against ``len(weights)``.
            rank: This process's rank; defaults to torch.distributed's, else 0.
            world_size: Number of ranks; defaults to torch.distributed's, else 1.

        Raises:
            DataError: Weights that are not 1-D, not finite, negative, all zero, or of
                the wrong length.
            ConfigError: ``num_samples`` below 1, more draws without replacement
                than samples with positive weight, or a bad rank or world size.
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
        self._start_epochs(seed, rank, world_size)

    def epoch_indices(self) -> torch.Tensor:
        """This rank's whole draw for the epoch, as one int64 tensor."""
        if self.world_size > 1 and self.replacement:
            # Independent draws need no coordination: a stream of its own per rank.
            generator = _generator(self.seed, self.epoch, stream=_RANK_STREAM + self.rank)
            return torch.multinomial(self.weights, len(self), True, generator=generator)
        draws = torch.multinomial(
            self.weights,
            self.num_samples,
            self.replacement,
            generator=_generator(self.seed, self.epoch),
        )
        return rank_slice(draws, self.rank, self.world_size, drop_last=False)

    def __len__(self) -> int:
        return math.ceil(self.num_samples / self.world_size)


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
    inverse: torch.Tensor
    counts: torch.Tensor
    _, inverse, counts = torch.unique(t.cpu(), return_inverse=True, return_counts=True)
    weights = 1.0 / counts.to(torch.float64)
    return weights[inverse]


def _labels_hint(dataset: Dataset[Any]) -> str:
    """How to make ``weights=balanced`` work for ``dataset``, whose labels are unknown."""
    inner, _, _ = innermost(dataset)
    kind = type(inner).__name__
    if type(inner).__module__.startswith("stoker."):
        # stoker's own source keeps no label column apart from its samples (JSONL, CSV).
        return (
            f"{kind} does not hold its labels apart from the samples: set loader.weights "
            "to one weight per sample (in Python: weights=balanced_weights(labels))"
        )
    return (
        f"give {kind} a `targets` attribute with one class id per sample (e.g. "
        "`self.targets = torch.tensor(labels)` in __init__), or set loader.weights to one "
        "weight per sample"
    )


def _sample_weights(dataset: Dataset[Any], weights: Any) -> torch.Tensor:
    """``weights`` for the samples of ``dataset``, taken from weights given for the whole.

    With ``data.val_fraction`` the loader reads the training part of a split, while the
    weights were written for the data as given: one per sample of the whole, mapped
    through the part's indices. Weights with one entry per sample of the part are used
    as they are.
    """
    w = _validate_weights(weights, None)
    count = len(dataset)  # type: ignore[arg-type]
    if w.numel() == count:
        return w
    indices = origin_indices(dataset, w.numel())
    if indices is not None:
        return w[indices]
    wholes = origin_lengths(dataset)
    given = f"{count} samples" + (
        f" (split from {wholes[-1]} by data.val_fraction)" if wholes else ""
    )
    fix = f"{wholes[-1]} (one per sample of data.train) or {count}" if wholes else f"{count}"
    raise DataError(
        f"loader.weights has {w.numel()} entries, but the training data has {given}; "
        "expected one weight per sample.",
        hint=f"give {fix} weights, in the order of the samples",
    )


def weighted_sampler_for(
    dataset: Dataset[Any], weights: Any, *, num_samples: int | None, seed: int
) -> EpochWeightedSampler:
    """The weighted sampler of ``loader.weights`` over ``dataset``.

    Args:
        dataset: The map-style dataset the loader reads (maybe the training part of a
            ``val_fraction`` split).
        weights: ``"balanced"`` (1 / count of the sample's class, from the labels the
            dataset knows without reading its samples), or one weight per sample of
            ``dataset`` or of the whole data it was split from.
        num_samples: Draws per epoch; defaults to one per sample.
        seed: Base seed of the draws.

    Raises:
        ConfigError: ``weights`` is a string other than ``balanced``.
        DataError: Unknown labels for ``balanced``, or weights that do not fit.
    """
    if isinstance(weights, str):
        if weights != "balanced":
            raise ConfigError(
                f"loader.weights={weights!r} is not understood; expected 'balanced' or one "
                "weight per sample.",
                hint="set loader.weights=balanced, or give a list of weights, one per sample",
            )
        targets = dataset_targets(dataset)
        if targets is None:
            _, _, name = innermost(dataset)
            raise DataError(
                f"loader.weights=balanced needs the labels of {name}, but they are not "
                "known without reading every sample.",
                hint=_labels_hint(dataset),
            )
        weights = balanced_weights(targets)
    else:
        weights = _sample_weights(dataset, weights)
    return EpochWeightedSampler(
        weights,
        num_samples=num_samples,
        seed=seed,
        dataset_len=len(dataset),  # type: ignore[arg-type]
    )
