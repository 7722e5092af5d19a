"""Datasets over in-memory arrays that fetch whole batches at once, and train/val splits."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Subset, TensorDataset

from stoker.data.cache import CachedDataset
from stoker.errors import ConfigError, DataError

__all__ = [
    "ArrayDataset",
    "dataset_lengths",
    "dataset_targets",
    "innermost",
    "length_or_none",
    "origin_indices",
    "origin_lengths",
    "split_dataset",
    "split_train_val_test",
]

ArrayLike = torch.Tensor | np.ndarray


def _field_label(position: int, names: Sequence[str] | None) -> str:
    if names is not None:
        return f"field {names[position]!r} (position {position})"
    return f"field {position}"


def _to_tensor(array: Any, label: str) -> torch.Tensor:
    """Turn one field into a tensor, sharing memory with a numpy array when possible."""
    if isinstance(array, torch.Tensor):
        tensor = array
    elif isinstance(array, np.ndarray):
        if array.dtype.kind not in "biufc":
            raise DataError(
                f"ArrayDataset {label} is a numpy array of dtype {array.dtype} "
                f"(kind {array.dtype.kind!r}); expected numbers or booleans.",
                hint="encode the field as numbers first, e.g. class ids with "
                "numpy.unique(values, return_inverse=True)[1], or keep text outside the "
                "ArrayDataset and tokenize it in a Dataset of your own",
            )
        if not array.dtype.isnative:
            array = array.astype(array.dtype.newbyteorder("="))
        try:
            # The dataset only reads its arrays, so the read-only warning is noise.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                tensor = torch.from_numpy(array)
        except ValueError:
            # Negative strides (e.g. a[::-1]) cannot be shared; one copy fixes it.
            tensor = torch.from_numpy(np.ascontiguousarray(array))
        except TypeError as error:
            raise DataError(
                f"ArrayDataset {label} has numpy dtype {array.dtype}, which torch cannot hold.",
                hint="convert it first, e.g. array.astype(numpy.float32)",
            ) from error
    else:
        raise DataError(
            f"ArrayDataset {label} is a {type(array).__name__}; "
            "expected a torch.Tensor or a numpy.ndarray.",
            hint="wrap it with numpy.asarray(...) or torch.as_tensor(...)",
        )
    if tensor.dim() == 0:
        raise DataError(
            f"ArrayDataset {label} is a scalar (0-d); expected an array whose first "
            "dimension indexes the samples.",
            hint="give one value per sample, e.g. a 1-D array of labels",
        )
    return tensor


class ArrayDataset(Dataset[Any]):
    """Samples stored as rows of tensors that share their first dimension.

    Like ``TensorDataset``, but ``__getitems__`` gathers a whole batch with one index
    operation per field, so a DataLoader built with :func:`stoker.data.build_loader`
    does no per-sample Python work. Numpy arrays are shared with ``torch.from_numpy``
    (no copy); the dataset never writes to its arrays.

    Example:
        >>> ds = ArrayDataset(features, labels, names=["x", "y"])
        >>> x_batch, y_batch = ds.__getitems__([0, 5, 7])
    """

    #: ``__getitems__`` returns one collated batch, not a list of samples.
    returns_batches = True

    def __init__(self, *arrays: ArrayLike, names: Sequence[str] | None = None) -> None:
        """Build the dataset.

        Args:
            *arrays: One tensor or numpy array per field (features, labels, metadata...),
                each with one row per sample.
            names: Optional field names, one per array, used in messages.

        Raises:
            DataError: No arrays, a field that is not numeric, or lengths that differ.
        """
        if not arrays:
            raise DataError(
                "ArrayDataset got no arrays; expected at least one (e.g. features, labels).",
                hint="call ArrayDataset(features, labels)",
            )
        if names is not None:
            names = tuple(str(name) for name in names)
            if len(names) != len(arrays):
                raise DataError(
                    f"ArrayDataset got {len(names)} names {list(names)} for {len(arrays)} "
                    "arrays; expected one name per array.",
                    hint=f"pass exactly {len(arrays)} names",
                )
            if len(set(names)) != len(names):
                raise DataError(
                    f"ArrayDataset names {list(names)} contain duplicates; expected unique names.",
                    hint="give every field its own name",
                )
        tensors = tuple(_to_tensor(array, _field_label(i, names)) for i, array in enumerate(arrays))
        lengths = [t.shape[0] for t in tensors]
        if len(set(lengths)) > 1:
            listed = ", ".join(f"{_field_label(i, names)} has {n}" for i, n in enumerate(lengths))
            raise DataError(
                f"ArrayDataset fields have different numbers of samples: {listed}; "
                "expected the same first dimension for every field.",
                hint="make every array hold one row per sample (check for a transposed "
                "array or a missing/extra row)",
            )
        self._arrays = tensors
        self._names: tuple[str, ...] | None = names
        # A part made by subset(): (rows of the whole, indices into it), for origin_indices.
        self._origin: tuple[int, torch.Tensor] | None = None
        self._length = lengths[0]
        # Devices other than the CPU need the index there too (e.g. a dataset kept on GPU).
        self._on_cpu = all(t.device.type == "cpu" for t in tensors)

    @classmethod
    def from_tensor_dataset(cls, dataset: TensorDataset) -> ArrayDataset:
        """Wrap a ``TensorDataset``'s tensors without copying them."""
        return cls(*dataset.tensors)

    @property
    def arrays(self) -> tuple[torch.Tensor, ...]:
        """The fields as tensors, one row per sample."""
        return self._arrays

    @property
    def names(self) -> tuple[str, ...] | None:
        """The field names, or None when none were given."""
        return self._names

    @property
    def targets(self) -> torch.Tensor | None:
        """The second field (the labels by convention), or None for a single field."""
        return self._arrays[1] if len(self._arrays) > 1 else None

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        i = operator.index(index)
        if not -self._length <= i < self._length:
            raise IndexError(
                f"sample index {i} is out of range for an ArrayDataset of {self._length} samples"
            )
        return tuple(t[i] for t in self._arrays)

    def __getitems__(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Gather the samples at ``indices`` as one batch, one index operation per field.

        Args:
            indices: Sample indices: a list, as the DataLoader's batch sampler yields
                them, or an int64 or int32 tensor (taken without a copy).

        Returns:
            One tensor per field, each with ``len(indices)`` rows.
        """
        if isinstance(indices, torch.Tensor) and indices.dtype in (torch.long, torch.int32):
            idx = indices  # the loader's fast path hands over index tensors: no conversion
        else:
            idx = torch.as_tensor(indices, dtype=torch.long)
        # index_select beats advanced indexing (t[idx]) on CPU: measured 9.6 vs 53.6 µs
        # for 1024 of 947k rows × 64 floats, 3.7 vs 5.7 µs for 64 of 10k × 20.
        if self._on_cpu:
            return tuple([t.index_select(0, idx) for t in self._arrays])
        return tuple([t.index_select(0, idx.to(t.device)) for t in self._arrays])

    def subset(self, indices: Sequence[int] | torch.Tensor) -> ArrayDataset:
        """A new ArrayDataset holding the rows at ``indices`` (gathered once, copied).

        The part remembers which rows of this dataset it holds (not the dataset itself,
        which it would keep alive), so per-sample weights given for the whole still map
        onto it (:func:`origin_indices`).
        """
        idx = torch.as_tensor(indices, dtype=torch.long)
        part = ArrayDataset(*self.__getitems__(idx), names=self._names)
        # int32 while it fits: half the memory of the int64 index, for a large part.
        small = self._length <= torch.iinfo(torch.int32).max
        part._origin = (self._length, idx.to(torch.int32) if small else idx)
        return part

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{self._names[i] if self._names else i}: {tuple(t.shape)} {t.dtype}"
            for i, t in enumerate(self._arrays)
        )
        return f"ArrayDataset({self._length} samples; {fields})"


def split_dataset(
    dataset: Dataset[Any], val_fraction: float, *, seed: int
) -> tuple[Dataset[Any], Dataset[Any]]:
    """Split a map-style dataset into train and validation parts, deterministically.

    The permutation comes from a ``torch.Generator`` seeded with ``seed``, so the split
    does not depend on the global RNG. Each part keeps the original sample order.

    Args:
        dataset: An ``ArrayDataset``, a ``TensorDataset`` or any map-style dataset.
        val_fraction: Share of samples for validation, strictly between 0 and 1.
        seed: Seed of the permutation.

    Returns:
        ``(train, val)``: ArrayDatasets for array/tensor datasets, otherwise ``Subset``s.

    Raises:
        ConfigError: ``val_fraction`` is not strictly between 0 and 1.
        DataError: The dataset is iterable, has no length, or has fewer than 2 samples.
    """
    train, val, _ = split_train_val_test(dataset, val_fraction=val_fraction, seed=seed)
    assert val is not None
    return train, val


def split_train_val_test(
    dataset: Dataset[Any],
    *,
    val_fraction: float | None,
    test_fraction: float | None = None,
    seed: int,
) -> tuple[Dataset[Any], Dataset[Any] | None, Dataset[Any] | None]:
    """Split off validation and test parts of a map-style dataset, deterministically.

    One permutation seeded with ``seed``: its first ``val_fraction`` share is the
    validation part — the same samples :func:`split_dataset` holds out, so adding a test
    share leaves the validation set as it was — the next ``test_fraction`` share of the
    whole is the test part, and the rest trains. Each part keeps the original order.

    Returns:
        ``(train, val, test)``; a part whose fraction is None is None.

    Raises:
        ConfigError: A fraction is not strictly between 0 and 1.
        DataError: The dataset is iterable, has no length, or is too small to give every
            part a sample.
    """
    for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        if fraction is None:
            continue
        number = isinstance(fraction, int | float) and not isinstance(fraction, bool)
        if not number or not 0.0 < fraction < 1.0:
            raise ConfigError(
                f"{name} must be strictly between 0 and 1; got {fraction!r}.",
                hint=f"use a fraction such as {name}=0.1, or give a separate "
                f"{'test' if name == 'test_fraction' else 'validation'} set",
            )
    which = "val_fraction" if test_fraction is None else "test_fraction"
    what = "validation" if test_fraction is None else "test"
    if isinstance(dataset, IterableDataset):
        raise DataError(
            f"cannot split {type(dataset).__name__}: it is an IterableDataset (a stream), "
            "which has no random access; expected a map-style dataset.",
            hint=f"give a separate {what} set instead of {which}",
        )
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError as error:
        raise DataError(
            f"cannot split {type(dataset).__name__}: it defines no __len__.",
            hint=f"define __len__ on the dataset, or give a separate {what} set",
        ) from error
    parts = 1 + (val_fraction is not None) + (test_fraction is not None)
    if n < parts:
        raise DataError(
            f"cannot split a dataset of {n} sample(s) into {parts} parts; "
            f"expected at least {parts}.",
            hint="give more data or separate validation and test sets",
        )
    n_val = min(max(round(n * val_fraction), 1), n - 1) if val_fraction is not None else 0
    n_test = 0
    if test_fraction is not None:
        n_test = min(max(round(n * test_fraction), 1), n - n_val - 1)
        if n_test < 1:
            n_val -= 1  # a tiny dataset: the test part takes one sample of the validation share
            n_test = 1
    generator = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=generator)
    indices = (perm[n_val + n_test :], perm[:n_val], perm[n_val : n_val + n_test])
    train_idx, val_idx, test_idx = (part.sort().values for part in indices)
    if isinstance(dataset, TensorDataset):
        dataset = ArrayDataset.from_tensor_dataset(dataset)

    def part(idx: torch.Tensor) -> Dataset[Any]:
        if isinstance(dataset, ArrayDataset):
            return dataset.subset(idx)
        return Subset(dataset, idx.tolist())

    return (
        part(train_idx),
        part(val_idx) if val_fraction is not None else None,
        part(test_idx) if test_fraction is not None else None,
    )


def _wrapped(dataset: Dataset[Any]) -> tuple[Dataset[Any], torch.Tensor | None] | None:
    """The dataset ``dataset`` reads from, and the indices into it (None: the same ones).

    A ``Subset`` (stoker's ``val_fraction`` split, or ``random_split``) reads the rows at
    its indices; a ``CachedDataset`` (``data.cache``) reads the same rows it serves.
    """
    if isinstance(dataset, Subset):
        return dataset.dataset, torch.as_tensor(dataset.indices, dtype=torch.long)
    if isinstance(dataset, CachedDataset):
        return dataset.dataset, None
    return None


def _per_sample(
    dataset: Dataset[Any], own: Callable[[Dataset[Any]], torch.Tensor | None]
) -> torch.Tensor | None:
    """``own(dataset)``, else that of the dataset it wraps, mapped onto its samples."""
    value = own(dataset)
    if value is not None:
        return value
    inner = _wrapped(dataset)
    if inner is None:
        return None
    values = _per_sample(inner[0], own)
    if values is None or inner[1] is None:
        return values
    return values[inner[1]]


def _own_targets(dataset: Dataset[Any]) -> torch.Tensor | None:
    if isinstance(dataset, TensorDataset):
        return dataset.tensors[1] if len(dataset.tensors) > 1 else None
    try:
        targets = getattr(dataset, "targets", None)
    except AttributeError:  # a wrapper's property that forwards to a dataset without them
        return None
    if targets is None or isinstance(targets, torch.Tensor):
        return targets
    try:
        return torch.as_tensor(np.asarray(targets))
    except (TypeError, ValueError, RuntimeError):
        return None


def _own_lengths(dataset: Dataset[Any]) -> Any:
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        return None
    if callable(lengths):
        lengths = lengths()
    if isinstance(lengths, torch.Tensor):
        return lengths
    try:
        return torch.as_tensor(np.asarray(lengths))
    except (TypeError, ValueError, RuntimeError):
        return lengths  # as given: the sampler's check says what is wrong with it


def dataset_targets(dataset: Dataset[Any]) -> torch.Tensor | None:
    """The labels of ``dataset`` if they are known without reading every sample.

    Known for ``ArrayDataset`` (second field), ``TensorDataset`` (second tensor), any
    dataset with a ``targets`` attribute that converts to a tensor (as torchvision
    datasets have), and a ``Subset`` (a ``val_fraction`` split) or ``CachedDataset`` of
    one of those: their labels are the wrapped dataset's, taken at their indices.

    Returns:
        One label per sample, or None when the labels are not cheaply known.
    """
    return _per_sample(dataset, _own_targets)


def length_or_none(sized: object) -> int | None:
    """``len(sized)``, or None for what has no length (a stream, or a loader over one)."""
    try:
        return len(sized)  # type: ignore[arg-type]
    except TypeError:
        return None


def dataset_lengths(dataset: Dataset[Any]) -> torch.Tensor | None:
    """The per-sample lengths of ``dataset`` (for ``sampler: bucket``), if it declares them.

    Known for a dataset with a ``lengths()`` method (or a ``lengths`` array), and for a
    ``Subset`` (a ``val_fraction`` split) or ``CachedDataset`` of one: their lengths are
    the wrapped dataset's, taken at their indices, so no sample is read again.

    Returns:
        The lengths as the dataset gives them (checked by the sampler), or None.
    """
    return _per_sample(dataset, _own_lengths)


def origin_indices(dataset: Dataset[Any], whole: int) -> torch.Tensor | None:
    """Which samples of an ``whole``-sample dataset ``dataset`` holds, if it is a part of one.

    Follows ``Subset``s, ``CachedDataset``s and :meth:`ArrayDataset.subset` parts (what
    ``val_fraction`` makes) up to a dataset of ``whole`` samples, so a per-sample value
    given for the whole data (``loader.weights``) can be taken for the training part.

    Returns:
        ``len(dataset)`` indices into that dataset, or None when ``dataset`` is not part
        of one with ``whole`` samples.
    """
    indices: torch.Tensor | None = None
    step: torch.Tensor | None
    current: Dataset[Any] | None = dataset
    while current is not None:
        if isinstance(current, ArrayDataset):
            if current._origin is None:
                return None
            length, step = current._origin
            current = None
        else:
            inner = _wrapped(current)
            if inner is None:
                return None
            current, step = inner
            if step is None:
                continue
            length = len(current)  # type: ignore[arg-type]
        indices = step if indices is None else step[indices]
        if length == whole:
            return indices
    return None


def origin_lengths(dataset: Dataset[Any]) -> list[int]:
    """The sample counts of the datasets ``dataset`` is a part of, nearest first.

    Empty for a dataset that is no ``Subset`` or ``val_fraction`` part; used to name,
    in a message, the lengths a per-sample value could have been given for.
    """
    lengths: list[int] = []
    current: Dataset[Any] | None = dataset
    while current is not None:
        if isinstance(current, ArrayDataset):
            if current._origin is not None:
                lengths.append(current._origin[0])
            return lengths
        inner = _wrapped(current)
        if inner is None:
            return lengths
        current = inner[0]
        if inner[1] is not None:
            lengths.append(len(current))  # type: ignore[arg-type]
    return lengths


def innermost(dataset: Dataset[Any]) -> tuple[Dataset[Any], torch.Tensor | None, str]:
    """The dataset under any ``Subset``/``CachedDataset`` wrappers, and how to reach it.

    Returns:
        ``(inner, indices, name)``: the wrapped dataset; the indices into it of
        ``dataset``'s samples (None when they are the same); and a name for messages
        that says what the user gave, e.g. ``Subset of TextListDataset`` for the
        training part of a ``val_fraction`` split.
    """
    names = []
    indices: torch.Tensor | None = None
    while (inner := _wrapped(dataset)) is not None:
        names.append(type(dataset).__name__)
        dataset, step = inner
        if step is not None:
            indices = step if indices is None else step[indices]
    names.append(type(dataset).__name__)
    return dataset, indices, " of ".join(names)
