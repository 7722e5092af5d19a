"""Caching of map-style samples whose loading is expensive, so each is made only once.

Wrap a dataset in :class:`CachedDataset` when loading a sample costs more than using it
(decoding an image or audio file, parsing a record, a database or network call) and the
result is the same every epoch; ``stoker doctor`` recommends it when sample loading
dominates step time. Random augmentation belongs after the cache (in the collate function
or the model), or every epoch would see the first epoch's augmentation.

- ``mode="memory"`` keeps samples in a dict in the process that loaded them. Use it when
  the decoded data fits in RAM. With ``num_workers=0`` the first epoch fills it. With
  worker processes each worker fills its own copy, which is lost when the workers stop
  (every epoch, unless ``persistent_workers=True``), so call :meth:`CachedDataset.warm`
  before building the loader: forked workers then share the filled cache copy-on-write.
  Tensors share best; many small Python objects get copied page by page as workers touch
  their reference counts.
- ``mode="disk"`` writes each sample into memory-mapped ``.npy`` files (one per field)
  under ``path`` the first time any process loads it, so every worker, later epochs and
  later runs read it from there (the OS page cache keeps hot rows in RAM). Use it when the
  data does not fit in RAM, with several workers, or to reuse decoding across runs. Every
  field must have one fixed shape and dtype (a tensor, numpy array or number).
"""

from __future__ import annotations

import json
import math
import mmap
import operator
import os
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset

from stoker.errors import ConfigError, DataError

try:  # fcntl exists on Linux and macOS; disk mode needs it to lock between workers.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["CacheMode", "CachedDataset"]

CacheMode = Literal["memory", "disk"]

_META = "meta.json"
_FILLED = "filled.npy"
_LOCK = ".lock"
_FORMAT = 1
_MEMORY_HINT = "use mode='memory', or make the field a tensor of one fixed shape in the dataset"


@dataclass(frozen=True)
class _Field:
    """One field of a sample as disk mode stores it."""

    name: str
    kind: Literal["tensor", "ndarray", "scalar", "bool", "int", "float"]
    dtype: str  # a torch dtype name for tensors ("bfloat16"), else a numpy dtype string
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.name!r}: {self.kind} {self.dtype} {self.shape}"

    def storage(self) -> np.dtype:
        """The numpy dtype of the field's file."""
        if self.kind != "tensor":
            return np.dtype(self.dtype)
        torch_dtype = getattr(torch, self.dtype)
        try:
            return torch.empty((), dtype=torch_dtype).numpy().dtype
        except TypeError:
            # numpy lacks bfloat16 and float8: store their bits as a same-size integer.
            return np.dtype(f"int{torch_dtype.itemsize * 8}")


def _split(sample: Any, index: int) -> tuple[str, list[tuple[str, Any]]]:
    """A sample's structure (``tuple``, ``list``, ``dict``, ``single``) and its fields."""
    if isinstance(sample, Mapping):
        if not all(isinstance(key, str) for key in sample):
            raise DataError(
                f"CachedDataset(mode='disk') cannot store sample {index}: a dict with keys "
                f"{list(sample)!r}; expected string keys.",
                hint=_MEMORY_HINT,
            )
        return "dict", list(sample.items())
    if isinstance(sample, tuple | list):
        structure = "list" if isinstance(sample, list) else "tuple"
        return structure, [(str(i), value) for i, value in enumerate(sample)]
    return "single", [("0", sample)]


def _describe(name: str, value: Any, index: int) -> _Field:
    if isinstance(value, torch.Tensor):
        return _Field(name, "tensor", str(value.dtype).removeprefix("torch."), tuple(value.shape))
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return _Field(name, "ndarray", value.dtype.str, value.shape)
    if isinstance(value, np.generic) and not isinstance(value, np.object_):
        return _Field(name, "scalar", value.dtype.str, ())
    # bool before int: bool is a subclass of int.
    for kind, python_type, dtype in (
        ("bool", bool, "|b1"),
        ("int", int, "<i8"),
        ("float", float, "<f8"),
    ):
        if isinstance(value, python_type):
            return _Field(name, kind, dtype, ())  # type: ignore[arg-type]
    raise DataError(
        f"CachedDataset(mode='disk') cannot store field {name!r} of sample {index}: a "
        f"{type(value).__name__}; expected a tensor, a numpy array or a number.",
        hint=_MEMORY_HINT,
    )


def _to_numpy(value: Any, field: _Field) -> np.ndarray:
    if field.kind == "tensor":
        # .cpu() waits for a GPU tensor's pending work (a CPU–GPU sync); rare in datasets.
        tensor: torch.Tensor = value.detach().cpu()
        try:
            return tensor.numpy()
        except TypeError:
            # bfloat16, float8: their bits, as the same-size integer the file holds.
            return tensor.view(getattr(torch, str(field.storage()))).numpy()
    return np.asarray(value, dtype=field.storage())


def _from_numpy(row: np.ndarray, field: _Field) -> Any:
    if field.kind == "tensor":
        tensor = torch.from_numpy(row)
        dtype = getattr(torch, field.dtype)
        return tensor if tensor.dtype == dtype else tensor.view(dtype)
    if field.kind == "ndarray":
        return row
    if field.kind == "scalar":
        return row[()]
    return {"bool": bool, "int": int, "float": float}[field.kind](row)


def _create_npy(file: Path, dtype: np.dtype, shape: tuple[int, ...]) -> None:
    """Write an ``.npy`` header and extend the file to full size (sparse until filled)."""
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    with open(file, "wb") as handle:
        np.lib.format.write_array_header_1_0(handle, header)
        handle.truncate(handle.tell() + math.prod(shape) * dtype.itemsize)


class _Rows:
    """A memory-mapped ``.npy`` file, written one row at a time."""

    def __init__(self, file: Path) -> None:
        with open(file, "r+b") as handle:
            version = np.lib.format.read_magic(handle)
            read = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read(handle)
            self._offset = handle.tell()
            self._map = mmap.mmap(handle.fileno(), 0)
        self.array = np.ndarray(shape, dtype=dtype, buffer=self._map, offset=self._offset)
        self._row_bytes = self.array.itemsize * math.prod(shape[1:])

    def write(self, index: int, value: Any) -> None:
        """Set one row and flush it to the file before returning."""
        self.array[index] = value
        if self._row_bytes:
            start = self._offset + index * self._row_bytes
            aligned = start - start % mmap.ALLOCATIONGRANULARITY
            self._map.flush(aligned, start + self._row_bytes - aligned)


class _DiskStore:
    """One process's view of a disk cache folder."""

    def __init__(self, root: Path, meta: dict[str, Any]) -> None:
        self.meta = meta
        self.structure: str = meta["structure"]
        self.fields = [_Field(**{**f, "shape": tuple(f["shape"])}) for f in meta["fields"]]
        self.filled = _Rows(root / _FILLED)
        self.rows = [_Rows(root / f"field_{i}.npy") for i in range(len(self.fields))]

    def is_filled(self, index: int) -> bool:
        return bool(self.filled.array[index])

    def read(self, index: int) -> Any:
        # A copy, so a caller that edits its sample in place cannot change the cache.
        values = [
            _from_numpy(np.array(rows.array[index]), field)
            for field, rows in zip(self.fields, self.rows, strict=True)
        ]
        if self.structure == "single":
            return values[0]
        if self.structure == "dict":
            return {field.name: value for field, value in zip(self.fields, values, strict=True)}
        return values if self.structure == "list" else tuple(values)

    def write(self, index: int, values: list[Any]) -> None:
        # Data first, then the flag, each flushed: a row is never marked filled before its
        # data is in the file, even if the process dies between the two.
        for field, rows, value in zip(self.fields, self.rows, values, strict=True):
            rows.write(index, _to_numpy(value, field))
        self.filled.write(index, 1)


class CachedDataset(Dataset[Any]):
    """A map-style dataset that loads each sample from ``dataset`` once, then from a cache.

    See the module docstring for when to use ``memory`` or ``disk`` mode. Samples come
    back as stored: do not modify them in place (disk mode returns fresh copies; memory
    mode returns the cached objects). ``hits`` and ``misses`` count this process's
    lookups; a worker's counts stay in the worker.

    Disk mode records the dataset's length, class and field layout in ``meta.json`` and
    refuses a folder made for other data. The check is structural: after changing the
    data behind a dataset of the same layout, delete the folder or use a new ``path``.

    Example:
        >>> images = CachedDataset(DecodedImages("photos/"), mode="disk", path="cache/photos")
        >>> loader = build_loader(images, batch_size=64, num_workers=8)
    """

    def __init__(
        self, dataset: Dataset[Any], *, mode: CacheMode = "memory", path: str | Path | None = None
    ) -> None:
        """Wrap ``dataset``.

        Args:
            dataset: A map-style dataset with ``__len__``.
            mode: ``memory`` (a dict per process) or ``disk`` (memory-mapped files).
            path: The cache folder for disk mode (created if missing).

        Raises:
            ConfigError: An unknown mode, or a ``path`` missing for disk mode or given for
                memory mode.
            DataError: The dataset is a stream or has no length, or the folder holds a
                cache made for other data or files that are not a cache.
        """
        if mode not in ("memory", "disk"):
            raise ConfigError(
                f"CachedDataset mode={mode!r}; expected 'memory' or 'disk'.",
                hint="use mode='memory' when the samples fit in RAM, else mode='disk'",
            )
        if mode == "disk" and path is None:
            raise ConfigError(
                "CachedDataset(mode='disk') needs a folder for the cache; got path=None.",
                hint="pass path='cache/my-data' (a new or empty folder, or an earlier cache)",
            )
        if mode == "memory" and path is not None:
            raise ConfigError(
                f"CachedDataset got path={str(path)!r}, but mode='memory' keeps no files.",
                hint="pass mode='disk' to cache in that folder, or drop path",
            )
        if mode == "disk" and fcntl is None:  # pragma: no cover - Windows
            raise ConfigError(
                "CachedDataset(mode='disk') needs file locks (fcntl), which this system lacks.",
                hint="use mode='memory'",
            )
        if isinstance(dataset, IterableDataset):
            raise DataError(
                f"CachedDataset cannot wrap {type(dataset).__name__}: it is an IterableDataset "
                "(a stream) without indices; expected a map-style dataset.",
                hint="cache inside the stream, or convert the data to a map-style dataset",
            )
        try:
            length = len(dataset)  # type: ignore[arg-type]
        except TypeError as error:
            raise DataError(
                f"CachedDataset cannot wrap {type(dataset).__name__}: it defines no __len__.",
                hint="define __len__ on the dataset",
            ) from error
        self.dataset = dataset
        self.mode: CacheMode = mode
        self.path = Path(path) if path is not None else None
        self.hits = 0
        self.misses = 0
        self._length = length
        self._memory: dict[int, Any] = {}
        # Marks a disk folder created by this object or its workers: there, a shape that
        # differs from the recorded one means the samples vary, not that the data changed.
        self._token = uuid.uuid4().hex
        self._reset_process_state()
        if self.path is not None:
            self.path.mkdir(parents=True, exist_ok=True)
            self._check_folder()

    # ------------------------------------------------------------ the Dataset protocol

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        i = operator.index(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(
                f"sample index {index} is out of range for a CachedDataset of "
                f"{self._length} samples"
            )
        if self.mode == "memory":
            if i in self._memory:
                self.hits += 1
                return self._memory[i]
            self.misses += 1
            sample = self._memory[i] = self.dataset[i]
            return sample
        store = self._disk()
        if store is not None and store.is_filled(i):
            self.hits += 1
            return store.read(i)
        self.misses += 1
        sample = self.dataset[i]
        self._write(i, sample)
        return sample

    @property
    def targets(self) -> Any:
        """The wrapped dataset's ``targets`` (AttributeError when it has none)."""
        return self.dataset.targets  # type: ignore[attr-defined]

    @property
    def num_cached(self) -> int:
        """How many samples the cache holds (this process's dict in memory mode)."""
        if self.mode == "memory":
            return len(self._memory)
        store = self._disk()
        return 0 if store is None else int(np.count_nonzero(store.filled.array))

    def warm(self, progress: bool = False) -> CachedDataset:
        """Load every sample not yet cached, in this process; returns ``self``.

        Call it before building a loader with workers: forked workers then inherit a
        filled memory cache, and a disk cache is complete before training starts.

        Args:
            progress: Show a progress bar.
        """
        indices: Any = range(self._length)
        if progress:
            from rich.progress import track

            indices = track(indices, description="caching samples", transient=True)
        for i in indices:
            if not self._is_cached(i):
                self[i]
        return self

    def __repr__(self) -> str:
        where = f", path='{self.path}'" if self.path is not None else ""
        return (
            f"CachedDataset({type(self.dataset).__name__}, mode='{self.mode}'{where}, "
            f"cached={self.num_cached}/{self._length}, hits={self.hits}, misses={self.misses})"
        )

    # ------------------------------------------------------------ pickling and processes

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Memory maps, descriptors and locks belong to one process; counts are per process.
        for key in ("_store", "_lock_fd", "_thread_lock", "_pid"):
            state[key] = None
        state["hits"] = state["misses"] = 0
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()

    def _reset_process_state(self) -> None:
        self._pid: int | None = os.getpid()
        self._store: _DiskStore | None = None
        self._lock_fd: int | None = None
        # flock excludes other processes only; threads of one process share its lock.
        self._thread_lock = threading.Lock()

    # ------------------------------------------------------------ disk mode

    def _is_cached(self, index: int) -> bool:
        if self.mode == "memory":
            return index in self._memory
        store = self._disk()
        return store is not None and store.is_filled(index)

    def _disk(self) -> _DiskStore | None:
        """This process's view of the cache folder; None until some process creates it."""
        if self._pid != os.getpid():
            # A forked worker: its parent's lock descriptor would share the parent's lock.
            self._reset_process_state()
        if self._store is None:
            assert self.path is not None
            meta = self._read_meta()
            if meta is not None:
                self._store = _DiskStore(self.path, meta)
        return self._store

    @contextmanager
    def _locked(self) -> Iterator[None]:
        assert self.path is not None and fcntl is not None
        with self._thread_lock:
            if self._lock_fd is None:
                self._lock_fd = os.open(self.path / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _write(self, index: int, sample: Any) -> None:
        structure, items = _split(sample, index)
        fields = [_describe(name, value, index) for name, value in items]
        self._disk()
        with self._locked():
            store = self._disk() or self._create(structure, fields)
            self._check_sample(store, structure, fields, index)
            if not store.is_filled(index):
                store.write(index, [value for _, value in items])

    def _create(self, structure: str, fields: list[_Field]) -> _DiskStore:
        """Lay out the folder from the first sample; called under the lock."""
        assert self.path is not None
        for i, field in enumerate(fields):
            _create_npy(self.path / f"field_{i}.npy", field.storage(), (self._length, *field.shape))
        _create_npy(self.path / _FILLED, np.dtype(np.uint8), (self._length,))
        meta = {
            "format": _FORMAT,
            "length": self._length,
            "source": type(self.dataset).__qualname__,
            "structure": structure,
            "fields": [{**asdict(field), "shape": list(field.shape)} for field in fields],
            "token": self._token,
        }
        # meta.json last, by rename: its presence means the files are complete.
        scratch = self.path / f".{_META}.{os.getpid()}.tmp"
        scratch.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        os.replace(scratch, self.path / _META)
        self._store = _DiskStore(self.path, meta)
        return self._store

    def _read_meta(self) -> dict[str, Any] | None:
        assert self.path is not None
        file = self.path / _META
        if not file.is_file():
            return None
        try:
            meta: dict[str, Any] = json.loads(file.read_text(encoding="utf-8"))
            valid = meta["format"] == _FORMAT and isinstance(meta["fields"], list)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            valid = False
        if not valid:
            raise DataError(
                f"{file} is not a stoker cache description (format {_FORMAT}).",
                hint=f"delete the folder {self.path} to rebuild the cache, or choose another path",
            )
        return meta

    def _check_folder(self) -> None:
        assert self.path is not None
        meta = self._read_meta()
        if meta is None:
            ours = {_META, _FILLED, _LOCK}
            foreign = sorted(
                entry.name
                for entry in self.path.iterdir()
                if entry.name not in ours
                and not (entry.name.startswith("field_") and entry.name.endswith(".npy"))
                and not entry.name.endswith(".tmp")
            )
            if foreign:
                raise DataError(
                    f"CachedDataset cache folder {self.path} holds other files "
                    f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); "
                    "expected a new or empty folder, or an earlier cache.",
                    hint="choose another path for the cache, e.g. a new folder",
                )
            return
        source = type(self.dataset).__qualname__
        if (meta["length"], meta["source"]) != (self._length, source):
            raise DataError(
                f"CachedDataset cache folder {self.path} was made for different data: it "
                f"holds {meta['length']} samples of a {meta['source']}, but this dataset is "
                f"a {source} of {self._length} samples.",
                hint=f"delete the folder {self.path} to rebuild the cache, "
                "or choose another path for this data",
            )

    def _check_sample(
        self, store: _DiskStore, structure: str, fields: list[_Field], index: int
    ) -> None:
        if (structure, fields) == (store.structure, store.fields):
            return
        own = store.meta.get("token") == self._token
        layout = [(f.name, f.kind, f.dtype) for f in fields]
        if (
            own
            and structure == store.structure
            and layout == [(f.name, f.kind, f.dtype) for f in store.fields]
        ):
            field, saved = next(
                (f, s) for f, s in zip(fields, store.fields, strict=True) if f.shape != s.shape
            )
            raise DataError(
                f"CachedDataset(mode='disk'): sample {index} field {field.name!r} has shape "
                f"{field.shape}, but earlier samples had {saved.shape}; disk mode stores one "
                "fixed shape per field.",
                hint=f"use mode='memory', or pad or crop field {field.name!r} to one shape "
                "in the dataset first",
            )
        expected = "; ".join(f.describe() for f in store.fields)
        got = "; ".join(f.describe() for f in fields)
        raise DataError(
            f"CachedDataset cache folder {self.path} was made for different data: it stores "
            f"{store.structure} samples of {expected}, but sample {index} is a {structure} of "
            f"{got}.",
            hint=f"delete the folder {self.path} to rebuild the cache, or choose another "
            "path; if sample shapes vary, use mode='memory' or pad them to one shape first",
        )
