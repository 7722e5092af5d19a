"""build_loader(): a DataLoader with batched fetch, per-epoch seeding and checked options."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    SequentialSampler,
    Subset,
    TensorDataset,
)
from torch.utils.data._utils.pin_memory import pin_memory

from stoker.data.collate import default_collate, passthrough
from stoker.data.samplers import (
    EpochRandomSampler,
    EpochWeightedSampler,
    balanced_weights,
    epoch_seed,
)
from stoker.data.sources import ArrayDataset, dataset_targets
from stoker.errors import ConfigError, DataError

__all__ = ["EpochLoader", "SamplerName", "build_loader"]

logger = logging.getLogger("stoker")

SamplerName = Literal["auto", "sequential", "random", "weighted"]
_SAMPLERS = ("auto", "sequential", "random", "weighted")
# Separates the worker-seed stream from the sampler's permutation stream of one epoch.
_WORKER_STREAM = 1


def _returns_batches(dataset: Dataset) -> bool:
    """Whether ``dataset.__getitems__`` yields one collated batch (also through a Subset)."""
    if isinstance(dataset, Subset):
        return _returns_batches(dataset.dataset)
    return bool(getattr(dataset, "returns_batches", False)) and hasattr(dataset, "__getitems__")


class _SampleView(Dataset):
    """A batched dataset seen one sample at a time, for a user collate_fn (no __getitems__)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]


class EpochLoader:
    """A DataLoader whose shuffling and worker seeds are fixed by ``(seed, epoch)``.

    Iterate it like the DataLoader it wraps. Before each pass it re-seeds the
    DataLoader's generator for the current epoch, so worker seeds (and the
    augmentation drawn from them) repeat exactly on resume. A pass that runs to the
    end advances ``epoch`` by one; :meth:`set_epoch` sets it explicitly.

    With ``persistent_workers`` the workers are seeded once, on the first pass, and
    keep their RNG state across epochs (PyTorch's behaviour).
    """

    def __init__(
        self,
        dataloader: DataLoader,
        *,
        seed: int = 0,
        epoch: int = 0,
        dataset: Dataset | None = None,
        returns_batches: bool = False,
    ) -> None:
        """Wrap ``dataloader``.

        Args:
            dataloader: The DataLoader; its ``generator`` (if any) is re-seeded per epoch.
            seed: Base seed, mixed with the epoch.
            epoch: The epoch of the first pass.
            dataset: The dataset as the user sees it; defaults to ``dataloader.dataset``.
            returns_batches: Whether the dataset fetches whole batches (reported only).
        """
        self.dataloader = dataloader
        self.dataset = dataset if dataset is not None else dataloader.dataset
        self.batch_size = dataloader.batch_size
        self.seed = int(seed)
        self.returns_batches = returns_batches
        # In the main process the DataLoader iterator only adds per-batch overhead
        # (profiler ranges, list-of-int indices); fetch the same batches directly.
        self._direct = (
            returns_batches
            and dataloader.num_workers == 0
            and dataloader.collate_fn is passthrough
            and type(dataloader.batch_sampler) is BatchSampler
        )
        self.epoch = 0
        self.set_epoch(epoch)

    @property
    def sampler(self) -> Sampler | None:
        """The sampler of a map-style dataset, or None for a stream."""
        if isinstance(self.dataloader.dataset, IterableDataset):
            return None
        return self.dataloader.sampler  # type: ignore[return-value]

    def set_epoch(self, epoch: int) -> None:
        """Select ``epoch``; forwarded to the sampler and dataset when they take it."""
        self.epoch = int(epoch)
        for part in (self.sampler, self.dataset):
            set_part_epoch = getattr(part, "set_epoch", None)
            if callable(set_part_epoch):
                set_part_epoch(self.epoch)

    def __iter__(self) -> Iterator[Any]:
        generator = self.dataloader.generator
        if generator is not None:
            # Worker base seeds are drawn from this generator when the iterator is built.
            generator.manual_seed(epoch_seed(self.seed, self.epoch, stream=_WORKER_STREAM))
        yield from self._direct_batches() if self._direct else self.dataloader
        self.set_epoch(self.epoch + 1)

    def _direct_batches(self) -> Iterator[Any]:
        """The batches the single-process DataLoader would yield, fetched with less overhead."""
        batch_sampler = self.dataloader.batch_sampler
        assert isinstance(batch_sampler, BatchSampler)
        size = batch_sampler.batch_size
        chunks = _sampler_indices(batch_sampler.sampler).split(size)
        # As BatchSampler: a short last batch only without drop_last, and never an empty one.
        if chunks and len(chunks[-1]) < (size if batch_sampler.drop_last else 1):
            chunks = chunks[:-1]
        dataset = self.dataloader.dataset
        fetch = dataset.__getitems__  # type: ignore[attr-defined]
        # ArrayDataset takes index tensors; other datasets get the list[int] PyTorch passes.
        as_list = not isinstance(dataset, ArrayDataset)
        pin = self.dataloader.pin_memory
        for idx in chunks:
            batch = fetch(idx.tolist() if as_list else idx)
            yield pin_memory(batch) if pin else batch

    def __len__(self) -> int:
        try:
            return len(self.dataloader)
        except TypeError as error:
            raise TypeError(
                f"this loader streams a {type(self.dataloader.dataset).__name__} "
                "(an IterableDataset) without __len__, so its number of batches is unknown; "
                "define __len__ on the dataset, or iterate without calling len()"
            ) from error

    def state_dict(self) -> dict[str, int]:
        """What resumes this loader: ``{"epoch"}``."""
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`."""
        self.set_epoch(int(state["epoch"]))

    def __repr__(self) -> str:
        return (
            f"EpochLoader(dataset={type(self.dataset).__name__}, batch_size={self.batch_size}, "
            f"epoch={self.epoch}, returns_batches={self.returns_batches})"
        )


def _sampler_indices(sampler: Sampler | Iterable[int]) -> torch.Tensor:
    """One epoch of a sampler's indices as an int64 tensor."""
    if isinstance(sampler, EpochRandomSampler | EpochWeightedSampler):
        return sampler.indices()
    if isinstance(sampler, SequentialSampler):
        return torch.arange(len(sampler))
    return torch.as_tensor(list(sampler), dtype=torch.long)


class Problem(NamedTuple):
    """One invalid or conflicting option: what is wrong, and the fix."""

    message: str
    fix: str


def _int_problem(name: str, value: Any, minimum: int) -> Problem | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return Problem(
            f"loader.{name} must be an int >= {minimum}; got {value!r}.",
            f"set loader.{name} to an int >= {minimum}",
        )
    return None


def _option_problems(
    *,
    batch_size: Any,
    num_workers: Any,
    num_samples: Any,
    prefetch_factor: Any,
    persistent_workers: bool,
    pin_memory: Any,
    sampler: Any,
) -> list[Problem]:
    """Problems with the options that do not depend on the dataset."""
    checks = [
        _int_problem("batch_size", batch_size, 1),
        _int_problem("num_workers", num_workers, 0),
        None if num_samples is None else _int_problem("num_samples", num_samples, 1),
        None if prefetch_factor is None else _int_problem("prefetch_factor", prefetch_factor, 1),
    ]
    no_workers = not isinstance(num_workers, int) or num_workers <= 0
    rules = [
        (
            prefetch_factor is not None and no_workers,
            f"loader.prefetch_factor={prefetch_factor} only applies to worker processes, "
            f"but loader.num_workers={num_workers}.",
            "set loader.num_workers>0 or drop loader.prefetch_factor",
        ),
        (
            persistent_workers and no_workers,
            "loader.persistent_workers=true keeps worker processes alive, "
            f"but loader.num_workers={num_workers}.",
            "set loader.num_workers>0 or set loader.persistent_workers=false",
        ),
        (
            pin_memory != "auto" and not isinstance(pin_memory, bool),
            f"loader.pin_memory={pin_memory!r}; expected true, false or auto.",
            "set loader.pin_memory=auto",
        ),
        (
            sampler not in _SAMPLERS,
            f"loader.sampler={sampler!r}; expected one of {', '.join(_SAMPLERS)}.",
            "set loader.sampler=auto",
        ),
    ]
    problems = [p for p in checks if p is not None]
    return problems + [Problem(message, fix) for bad, message, fix in rules if bad]


def _resolve_sampler(
    sampler: str,
    *,
    shuffle: bool,
    weights: Any,
    num_samples: int | None,
    dataset: Dataset,
    problems: list[Problem],
) -> str:
    """The sampler ``auto`` stands for; adds problems for contradicting options."""
    streaming = isinstance(dataset, IterableDataset)
    if streaming:
        resolved = "sequential"
    elif sampler == "auto":
        # Weighted draws are random, so weights satisfy shuffle=true as well.
        resolved = "weighted" if weights is not None else "random" if shuffle else "sequential"
    else:
        resolved = sampler
    reorders = shuffle or sampler in ("random", "weighted") or weights is not None
    what = (
        "loader.shuffle=true" if shuffle
        else "loader.weights" if weights is not None
        else f"loader.sampler={sampler}"
    )  # fmt: skip
    rules = [
        (
            streaming and reorders,
            f"{what} cannot reorder {type(dataset).__name__}: it is an IterableDataset "
            "(a stream) that decides its own order.",
            "shuffle or resample inside the stream (e.g. a shuffle buffer), and set "
            "loader.shuffle=false, loader.sampler=auto and no loader.weights",
        ),
        (
            not streaming and shuffle and sampler == "sequential",
            "loader.shuffle=true conflicts with loader.sampler=sequential, which reads in order.",
            "set loader.shuffle=false, or set loader.sampler=random (or auto)",
        ),
        (
            not streaming and sampler == "weighted" and weights is None,
            "loader.sampler=weighted needs per-sample weights, but loader.weights is unset.",
            "set loader.weights=balanced for class balancing, or give one weight per sample",
        ),
        (
            not streaming and sampler in ("sequential", "random") and weights is not None,
            f"loader.weights is set, but loader.sampler={sampler} does not use weights.",
            "set loader.sampler=weighted (or auto), or drop loader.weights",
        ),
        (
            resolved != "weighted" and num_samples is not None,
            f"loader.num_samples={num_samples} is only used by the weighted sampler, "
            f"but the sampler is {resolved}.",
            "drop loader.num_samples, or set loader.weights",
        ),
    ]
    problems.extend(Problem(message, fix) for bad, message, fix in rules if bad)
    return resolved


def _raise_all(problems: list[Problem]) -> None:
    """Raise one ConfigError that lists every problem found."""
    if len(problems) == 1:
        raise ConfigError(problems[0][0], hint=problems[0][1])
    if problems:
        message = "invalid loader options:\n" + "\n".join(f"  - {m}" for m, _ in problems)
        raise ConfigError(message, hint="; ".join(h for _, h in problems))


def _resolve_pin_memory(pin_memory: bool | str, device: str | torch.device | None) -> bool:
    device_type = None
    if device is not None and str(device) != "auto":
        try:
            device_type = torch.device(device).type
        except (RuntimeError, ValueError) as error:
            raise ConfigError(
                f"device={device!r} is not a device; expected auto, cpu, cuda, cuda:N or mps.",
                hint="set train.device=auto",
            ) from error
    cuda = torch.cuda.is_available()
    if pin_memory == "auto":
        return cuda and device_type in (None, "cuda")
    if pin_memory and not cuda:
        logger.warning(
            "loader.pin_memory=true but CUDA is not available; loading without pinned "
            "memory (set loader.pin_memory=auto to silence this)"
        )
        return False
    return bool(pin_memory)


def _dataset_length(dataset: Dataset) -> int:
    try:
        length = len(dataset)  # type: ignore[arg-type]
    except TypeError as error:
        raise DataError(
            f"{type(dataset).__name__} is a map-style Dataset without __len__; "
            "the loader needs the number of samples to index it.",
            hint="define __len__ on the dataset, or make it an IterableDataset",
        ) from error
    if length == 0:
        raise DataError(
            f"{type(dataset).__name__} has 0 samples; expected at least one.",
            hint="check the data path and any filtering that produced the dataset",
        )
    return length


def _weighted_sampler(
    dataset: Dataset, weights: Any, *, num_samples: int | None, seed: int
) -> EpochWeightedSampler:
    if isinstance(weights, str):
        if weights != "balanced":
            raise ConfigError(
                f"loader.weights={weights!r} is not understood; expected 'balanced' or one "
                "weight per sample.",
                hint="set loader.weights=balanced, or pass a 1-D array of weights",
            )
        targets = dataset_targets(dataset)
        if targets is None:
            raise DataError(
                f"loader.weights=balanced needs the labels of {type(dataset).__name__}, "
                "but they are not known without reading every sample.",
                hint="use an ArrayDataset with the labels as its second field, give the "
                "dataset a `targets` attribute, or pass weights=balanced_weights(labels)",
            )
        weights = balanced_weights(targets)
    return EpochWeightedSampler(
        weights,
        num_samples=num_samples,
        seed=seed,
        dataset_len=len(dataset),  # type: ignore[arg-type]
    )


def build_loader(
    dataset: Dataset,
    *,
    batch_size: int = 64,
    shuffle: bool = False,
    drop_last: bool = False,
    sampler: SamplerName = "auto",
    weights: torch.Tensor | np.ndarray | Sequence[float] | Literal["balanced"] | None = None,
    num_samples: int | None = None,
    num_workers: int = 0,
    pin_memory: bool | Literal["auto"] = "auto",
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> EpochLoader:
    """Build a DataLoader with stoker's fast paths, wrapped in an :class:`EpochLoader`.

    Datasets that fetch whole batches (``ArrayDataset``; a ``TensorDataset`` is
    converted to one without copying) get a pass-through collate, so each batch is one
    gather per field. Any other map-style or iterable dataset is used as is.

    Args:
        dataset: A map-style ``Dataset`` or an ``IterableDataset``.
        batch_size: Samples per batch.
        shuffle: Shuffle each epoch (picks the ``random`` sampler under ``auto``).
        drop_last: Drop the last, smaller batch.
        sampler: ``auto`` (``weighted`` if weights are given, else ``random`` if shuffle,
            else ``sequential``), ``sequential``, ``random`` or ``weighted``.
        weights: Per-sample weights for the weighted sampler, or ``"balanced"`` to
            weight each sample by ``1 / count(its class)``.
        num_samples: Draws per epoch for the weighted sampler (default: dataset length).
        num_workers: Worker processes; 0 loads in the main process.
        pin_memory: Pin batches for faster copies to the GPU; ``auto`` pins when CUDA is
            available and ``device`` (if given) is a CUDA device.
        persistent_workers: Keep workers alive between epochs (needs ``num_workers > 0``).
        prefetch_factor: Batches each worker loads ahead (needs ``num_workers > 0``).
        collate_fn: Your collate function; it receives a list of samples.
        seed: Base seed of shuffling, weighted draws and worker seeds.
        device: The training device, used to decide ``pin_memory="auto"``.

    Returns:
        The loader.

    Raises:
        ConfigError: Invalid or conflicting options, all listed, each by its ``loader.*`` key.
        DataError: An empty dataset, a map-style dataset without ``__len__``, or
            ``weights="balanced"`` for a dataset whose labels are unknown.
    """
    problems = _option_problems(
        batch_size=batch_size,
        num_workers=num_workers,
        num_samples=num_samples,
        prefetch_factor=prefetch_factor,
        persistent_workers=persistent_workers,
        pin_memory=pin_memory,
        sampler=sampler,
    )
    resolved = _resolve_sampler(
        sampler,
        shuffle=shuffle,
        weights=weights,
        num_samples=num_samples,
        dataset=dataset,
        problems=problems,
    )
    _raise_all(problems)

    streaming = isinstance(dataset, IterableDataset)
    if isinstance(dataset, TensorDataset):
        dataset = ArrayDataset.from_tensor_dataset(dataset)
    length = 0 if streaming else _dataset_length(dataset)

    batched = not streaming and _returns_batches(dataset)
    fetched: Dataset = dataset
    if batched and collate_fn is None:
        collate_fn = passthrough
    elif batched:
        # A user collate_fn expects a list of samples, as PyTorch gives it.
        fetched, batched = _SampleView(dataset), False
    elif collate_fn is None:
        collate_fn = default_collate

    index_sampler: Sampler | None = None
    if resolved == "random":
        index_sampler = EpochRandomSampler(length, seed=seed)
    elif resolved == "weighted":
        index_sampler = _weighted_sampler(dataset, weights, num_samples=num_samples, seed=seed)
    elif not streaming:
        index_sampler = SequentialSampler(fetched)  # type: ignore[arg-type]

    worker_options: dict[str, Any] = {}
    if num_workers > 0:
        worker_options["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            worker_options["prefetch_factor"] = prefetch_factor

    dataloader = DataLoader(
        fetched,
        batch_size=batch_size,
        shuffle=False,
        sampler=index_sampler,
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=_resolve_pin_memory(pin_memory, device),
        drop_last=drop_last,
        # Re-seeded by EpochLoader before every pass; never the global RNG.
        generator=torch.Generator(),
        **worker_options,
    )
    return EpochLoader(dataloader, seed=seed, dataset=dataset, returns_batches=batched)
