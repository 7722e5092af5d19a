"""NpyDataset: samples read from .npy files (memory-mapped or by position), a batch per read."""

from __future__ import annotations

import io
import logging
import mmap
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from stoker.data.npy_fields import TARGET_NAMES, NpyFields, _field_paths, _native, _open_npy
from stoker.errors import ConfigError, DataError

logger = logging.getLogger("stoker")

__all__ = ["TARGET_NAMES", "NpyDataset", "NpyFields"]

# What one read fault can map: recent Linux (6.18 here) maps the whole page-cache folio
# around the faulting page, and ext4, xfs and btrfs cache files in folios of up to 2 MiB,
# so reading one 256-byte row can map 2 MiB of the file into the process (older kernels
# map a 64 KiB "fault-around" window, so this overestimates there). Mapped bytes are
# counted in these units of the file: a read maps at most the folios its rows span.
_FOLIO = 2 << 20
# A mapped read of scattered rows costs about a page fault per folio it maps, a read by
# position a pread per run of rows, and mapping a folio again after a release costs
# several small preads (1 GB of 256-byte rows in 2 MiB folios, 2-core VM: ~5 us a fault,
# ~1 us a pread; by position was faster up to about 9 rows per folio spanned). So a batch
# over the budget with fewer rows than this per folio of its span is read by position.
# (Over small folios, after memory pressure, a fault maps 64 KiB and batches just denser
# than this map a few times slower than by position; counting in 64 KiB units instead
# would read dense batches over large folios many times slower than mapped.)
_ROWS_PER_FOLIO = 8
# Python exposes madvise only where the OS has it (not on Windows).
_CAN_RELEASE = hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED")
# pread reads at an offset in one call (no shared file position); elsewhere seek + read.
_HAS_PREAD = hasattr(os, "pread")


def normalize_indices(
    indices: Sequence[int] | torch.Tensor | np.ndarray, length: int
) -> np.ndarray:
    """Sample indices as a 1-D int64 array in ``[0, length)``; negative ones count from the end.

    Raises:
        IndexError: An index outside ``[-length, length)``.
    """
    if isinstance(indices, torch.Tensor):
        idx = indices.detach().to("cpu", torch.long).numpy().reshape(-1)
    else:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size == 0:
        return idx
    low, high = idx.min(), idx.max()
    if low < -length or high >= length:
        bad = int(low) if low < -length else int(high)
        raise IndexError(f"sample index {bad} is out of range for a dataset of {length} samples")
    if low < 0:
        idx = np.where(idx < 0, idx + length, idx)
    return idx


def _read_at(stream: io.RawIOBase, size: int, offset: int) -> bytes:
    stream.seek(offset)
    return stream.read(size) or b""


def _read_rows(path: Path, array: np.memmap, idx: np.ndarray) -> np.ndarray:
    """The rows at sorted ``idx`` read by position into a new array; nothing is mapped."""
    row_shape = array.shape[1:]
    row_bytes = int(np.prod(row_shape, dtype=np.int64)) * array.itemsize
    if not idx.size:
        return np.empty((0, *row_shape), dtype=array.dtype)
    # Runs of consecutive rows are read in one call: a sequential batch is a single read.
    cuts = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], cuts))
    sizes = (np.diff(np.append(starts, idx.size)) * row_bytes).tolist()
    offsets = (array.offset + idx[starts] * row_bytes).tolist()
    with path.open("rb", buffering=0) as stream:
        pairs = zip(sizes, offsets, strict=True)
        if _HAS_PREAD:
            fd = stream.fileno()
            parts = [os.pread(fd, size, offset) for size, offset in pairs]
        else:
            parts = [_read_at(stream, size, offset) for size, offset in pairs]
    # bytearray: one copy, and a writable buffer that torch.from_numpy accepts silently.
    data = bytearray().join(parts)
    if len(data) != idx.size * row_bytes:
        raise DataError(
            f"NpyDataset file {path} is shorter than its header says (a partial write?).",
            hint="write the file again",
        )
    return np.frombuffer(data, dtype=array.dtype).reshape(idx.size, *row_shape)


class NpyDataset(Dataset[Any]):
    """Samples stored as .npy files, one file per field; the files need not fit in memory.

    Opening reads only the headers. ``__getitems__`` sorts a batch's indices (so reads
    move forward through the files), reads those rows of every field, restores the
    requested order and returns one collated batch of tensors that own their memory.

    Two ways to read (``mmap``):

    - ``True``: through memory maps, one fancy-index per field; the fastest. Mapped
      pages count toward the process's resident memory (RSS) although they are the OS
      page cache, and a read fault maps a whole page-cache folio (up to 2 MiB on recent
      Linux) however small the row. So reads are counted in folios against a budget,
      ``max_mapped_mib``, and the maps are handed back (``madvise(MADV_DONTNEED)``;
      the pages stay cached) before a read would overrun it. A batch that would
      overrun it with few rows per folio it spans (a shuffled batch over a file much
      larger than the budget, which would map nearly all of it for a row or two per
      folio) is read by position instead, as with ``False``: mapping those folios
      again after every release costs more than reading the rows. Files that fit the
      budget together stay mapped once read.
    - ``False``: by position (``pread``), one read per run of consecutive rows:
      nothing is mapped, RSS holds the batch only, whatever the order; slower than
      mapped reads of a file that stays mapped.

    Picklable for DataLoader workers: mapped arrays are not pickled; each process maps
    the files again on first use.

    Example:
        >>> ds = NpyDataset("data/train")  # data/train/features.npy, data/train/target.npy
        >>> x, y = ds.__getitems__([3, 0, 7])
    """

    #: ``__getitems__`` returns one collated batch, not a list of samples.
    returns_batches = True

    def __init__(
        self,
        fields: NpyFields,
        *,
        mmap: bool = True,
        max_mapped_mib: int | None = 128,
        float64: Literal["keep", "float32"] = "keep",
    ) -> None:
        """Open the fields.

        Args:
            fields: A folder (every ``*.npy`` in it, one field per file, sorted by name,
                except that a target field named as in :data:`TARGET_NAMES` comes second
                so samples are ``(inputs, target, *extra)``), a mapping name → path, or a
                sequence of paths (named after their files). The order is the order of
                the fields in a sample.
            mmap: Read through memory maps (True) or by position (False); see above.
            max_mapped_mib: With ``mmap``, keep at most about this many MiB of the files
                mapped (see above); None keeps every page read mapped and never reads
                by position.
            float64: ``"float32"`` reads float64 fields (NumPy's default dtype) as
                float32, the dtype of a model's weights, with one note naming the files;
                ``"keep"`` gives them as stored.

        Raises:
            DataError: A missing file or folder, a file that is not a numeric .npy array,
                fields with different numbers of rows (each file and its length named),
                or a Fortran-ordered file with ``mmap=False``.
            ConfigError: ``max_mapped_mib`` is not None or an int >= 0.
        """
        if max_mapped_mib is not None and (
            isinstance(max_mapped_mib, bool)
            or not isinstance(max_mapped_mib, int)
            or max_mapped_mib < 0
        ):
            raise ConfigError(
                f"NpyDataset max_mapped_mib must be None or an int >= 0; got {max_mapped_mib!r}.",
                hint="use e.g. max_mapped_mib=128, or None to keep every read page mapped",
            )
        if float64 not in ("keep", "float32"):
            raise ConfigError(
                f"NpyDataset float64 must be 'keep' or 'float32'; got {float64!r}.",
                hint="use float64: float32 to read float64 fields as float32, or keep",
            )
        names, paths = _field_paths(fields)
        # Mapping reads only the headers, so checking every field here is cheap.
        arrays = [_open_npy(path) for path in paths]
        lengths = [a.shape[0] for a in arrays]
        if len(set(lengths)) > 1:
            listed = ", ".join(f"{p} has {n}" for p, n in zip(paths, lengths, strict=True))
            raise DataError(
                f"NpyDataset fields have different numbers of rows: {listed}; expected the "
                "same first dimension in every file.",
                hint="write every field with one row per sample (check for a transposed "
                "array or a file from another dataset)",
            )
        if not mmap:
            fortran = [
                str(p) for p, a in zip(paths, arrays, strict=True) if not a.flags.c_contiguous
            ]
            if fortran:
                raise DataError(
                    f"NpyDataset mmap=False reads rows by position, but {fortran} are stored "
                    "in Fortran order, where a row is not contiguous.",
                    hint="save them with numpy.save(path, numpy.ascontiguousarray(a)), "
                    "or use mmap=True",
                )
        self._names = names
        self._paths = paths
        # Cast per batch, not up front: the files need not fit in memory.
        self._cast = tuple(float64 == "float32" and a.dtype == np.float64 for a in arrays)
        if any(self._cast):
            wide = ", ".join(p.name for p, cast in zip(paths, self._cast, strict=True) if cast)
            logger.warning(
                "npy: %s in %s hold float64 (NumPy's default): read as float32, the model's "
                "dtype (float64: keep reads them as stored)",
                wide,
                paths[0].parent,
            )
        self._length: int = lengths[0]
        self._mmap = bool(mmap)
        self._max_mapped = None if max_mapped_mib is None else max_mapped_mib << 20
        row_bytes = [int(np.prod(a.shape[1:], dtype=np.int64)) * a.itemsize for a in arrays]
        self._row_bytes = tuple(row_bytes)
        # The most of each file a map can hold: the header and the rows.
        self._sizes = tuple(a.offset + a.nbytes for a in arrays)
        self._c_order = tuple(bool(a.flags.c_contiguous) for a in arrays)
        # By position, the maps give only shape, dtype and offset: no page is touched.
        self._arrays: list[np.memmap] | None = arrays
        self._forget_mapped()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # Mapped arrays are reopened in each process, never pickled.
        state["_arrays"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._forget_mapped()  # nothing is mapped in this process yet

    def _forget_mapped(self) -> None:
        """Count nothing as mapped: on opening, in a new process and after a release."""
        fields = len(self._paths)
        # Per field and in all, an upper bound of what reads mapped since a release.
        self._mapped = [0] * fields
        self._mapped_total = 0
        # Per field, the last folio counted: a sequential batch starts in it.
        self._last_folio = [-1] * fields

    def _fields(self) -> list[np.memmap]:
        if self._arrays is None:
            self._arrays = [_open_npy(p) for p in self._paths]
        return self._arrays

    @property
    def names(self) -> tuple[str, ...]:
        """The field names, in sample order."""
        return self._names

    @property
    def paths(self) -> tuple[Path, ...]:
        """The field files, in sample order."""
        return self._paths

    @property
    def target_name(self) -> str | None:
        """The field taken as the target: one named in :data:`TARGET_NAMES`, else the second."""
        named = next((n for n in TARGET_NAMES if n in self._names), None)
        if named is not None:
            return named
        return self._names[1] if len(self._names) > 1 else None

    @property
    def targets(self) -> torch.Tensor | None:
        """The target field as one tensor (None for a single field).

        This reads the whole column from disk on every access (one value per sample),
        so keep the result rather than asking again.
        """
        name = self.target_name
        if name is None:
            return None
        position = self._names.index(name)
        column = self._fields()[position]
        if not column.flags.c_contiguous:
            return torch.from_numpy(self._as_read(position, _native(np.array(column))))
        # A plain read, whatever the mode, so the column does not stay mapped.
        values = np.fromfile(
            self._paths[position], dtype=column.dtype, count=column.size, offset=column.offset
        )
        return torch.from_numpy(self._as_read(position, _native(values.reshape(column.shape))))

    def _as_read(self, field: int, rows: np.ndarray) -> np.ndarray:
        """``rows`` of ``field`` in the dtype a sample has: float32 for a cast float64 field."""
        return rows.astype(np.float32) if self._cast[field] else rows

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[0] for t in self.__getitems__([index]))

    def __getitems__(self, indices: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Read the samples at ``indices`` as one batch: one gather (or run of reads) per field.

        Args:
            indices: Sample indices, as the DataLoader's batch sampler yields them (or
                an int64 tensor).

        Returns:
            One tensor per field, each with ``len(indices)`` rows, in the order asked.
        """
        idx = normalize_indices(indices, self._length)
        order = None
        if idx.size > 1 and bool(np.any(idx[1:] < idx[:-1])):
            # Reading in file order turns random reads into mostly forward ones.
            order = np.argsort(idx, kind="stable")
            idx = idx[order]
        batch = []
        for field, (path, array) in enumerate(zip(self._paths, self._fields(), strict=True)):
            rows = self._read(field, path, array, idx)
            if order is not None:
                unsorted = np.empty_like(rows)
                unsorted[order] = rows
                rows = unsorted
            batch.append(torch.from_numpy(self._as_read(field, _native(rows))))
        return tuple(batch)

    def _read(self, field: int, path: Path, array: np.memmap, idx: np.ndarray) -> np.ndarray:
        """One field's rows at sorted ``idx``, in a new array: mapped or by position.

        Mapped reads are counted in whole folios of the span they cover (an upper bound
        of what they map). A read that fits what is left of the budget goes through the
        map. One that does not is read by position when its rows are sparse (fewer than
        ``_ROWS_PER_FOLIO`` per folio spanned), else mapped a piece at a time, the maps
        released before a piece that would overrun the budget.
        """
        if not self._mmap:
            return _read_rows(path, array, idx)
        if self._max_mapped is None or not _CAN_RELEASE or not idx.size:
            # Advanced indexing copies out of the map.
            return np.asarray(array[idx])
        start, end = self._span(field, array, idx)
        new = self._uncounted(field, start, end)
        if self._mapped_total + new <= self._max_mapped:
            rows = np.asarray(array[idx])
            self._count(field, new, end)
            return rows
        if idx.size < _ROWS_PER_FOLIO * (end - start) and self._c_order[field]:
            return _read_rows(path, array, idx)
        return self._read_in_pieces(field, array, idx)

    def _read_in_pieces(self, field: int, array: np.memmap, idx: np.ndarray) -> np.ndarray:
        """Rows at sorted ``idx`` through the map, each piece spanning at most the budget.

        The maps are released before a piece that would overrun the budget, so even a
        batch larger than the budget never has much more than the budget mapped at once.
        (Not in Fortran order: any few rows span the whole file, so it is one piece.)
        """
        assert self._max_mapped is not None
        cuts: np.ndarray | list[int] = []
        if self._c_order[field]:
            # Pieces cut at multiples of the budget in the file (at least a folio apart).
            piece = max(self._max_mapped // _FOLIO, 1) * _FOLIO
            offsets = array.offset + idx * self._row_bytes[field]
            cuts = np.flatnonzero(np.diff(offsets // piece)) + 1
        parts = []
        for part in np.split(idx, cuts):
            start, end = self._span(field, array, part)
            if self._mapped_total + self._uncounted(field, start, end) > self._max_mapped:
                self._release_pages()
            parts.append(np.asarray(array[part]))
            self._count(field, self._uncounted(field, start, end), end)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _span(self, field: int, array: np.memmap, idx: np.ndarray) -> tuple[int, int]:
        """The folios ``[start, end)`` of its file that the rows at sorted ``idx`` lie in."""
        if not self._c_order[field]:
            return 0, -(-self._sizes[field] // _FOLIO)  # a Fortran-order row spans the file
        row_bytes = self._row_bytes[field]
        start = (array.offset + int(idx[0]) * row_bytes) // _FOLIO
        end = -(-(array.offset + (int(idx[-1]) + 1) * row_bytes) // _FOLIO)
        return start, end

    def _uncounted(self, field: int, start: int, end: int) -> int:
        """Bytes that mapping folios ``[start, end)`` of ``field`` may add to its count."""
        folios = max(end - start - (start == self._last_folio[field]), 0)
        # A map holds at most its whole file, however often it is read.
        return min(folios * _FOLIO, self._sizes[field] - self._mapped[field])

    def _count(self, field: int, nbytes: int, end: int) -> None:
        self._mapped[field] += nbytes
        self._mapped_total += nbytes
        self._last_folio[field] = end - 1

    def _release_pages(self) -> None:
        """Drop this process's mapped pages; they stay in the OS page cache."""
        self._forget_mapped()
        for array in self._arrays or ():
            mapping = getattr(array, "_mmap", None)  # np.memmap keeps its mmap object here
            if isinstance(mapping, mmap.mmap):
                mapping.madvise(mmap.MADV_DONTNEED)

    def __repr__(self) -> str:
        fields = ", ".join(f"{n}: {p.name}" for n, p in zip(self._names, self._paths, strict=True))
        mode = "mapped" if self._mmap else "read by position"
        return f"NpyDataset({self._length} samples, {mode}; {fields})"
