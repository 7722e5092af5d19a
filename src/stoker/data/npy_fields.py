""".npy fields: which files a folder, list or mapping names, and each opened by its header.

numpy only, no torch: split from :mod:`stoker.data.memmap` so that ``stoker data inspect``
opens .npy files as :class:`~stoker.data.memmap.NpyDataset` does without importing torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from stoker.errors import DataError

#: Field names taken as the target (the labels), in this order of preference.
TARGET_NAMES = ("label", "labels", "target", "targets", "y")

PathLike = str | os.PathLike[str]
NpyFields = PathLike | Mapping[str, PathLike] | Sequence[PathLike]


def _field_paths(fields: NpyFields) -> tuple[tuple[str, ...], tuple[Path, ...]]:
    """Names and paths of the fields, in sample order."""
    if isinstance(fields, Mapping):
        return tuple(str(name) for name in fields), tuple(Path(p) for p in fields.values())
    if isinstance(fields, str | os.PathLike):
        folder = Path(fields)
        if not folder.exists():
            raise DataError(
                f"NpyDataset path {folder} does not exist; expected a folder of .npy files "
                "or a .npy file.",
                hint="check the path (convert a CSV with `stoker data convert ... --to npy`)",
            )
        if not folder.is_dir():
            return (folder.stem,), (folder,)
        paths = sorted(folder.glob("*.npy"), key=lambda p: p.name)
        if not paths:
            raise DataError(
                f"NpyDataset folder {folder} holds no *.npy files; expected one file per "
                "field (e.g. features.npy and target.npy).",
                hint="point at the folder the .npy files are in",
            )
        names = [p.stem for p in paths]
        # Samples go to the loop as (inputs, targets, *extra): the target comes second.
        target = next((n for n in TARGET_NAMES if n in names), None)
        if target is not None and len(names) > 1:
            position = names.index(target)
            names.insert(1, names.pop(position))
            paths.insert(1, paths.pop(position))
        return tuple(names), tuple(paths)
    paths = [Path(p) for p in fields]
    names = [p.stem for p in paths]
    if len(set(names)) != len(names):
        raise DataError(
            f"NpyDataset got files with the same name {[str(p) for p in paths]}; "
            "each field is named after its file, so names must differ.",
            hint="pass a mapping instead, e.g. NpyDataset({'x': path1, 'y': path2})",
        )
    return tuple(names), tuple(paths)


def _open_npy(path: Path) -> np.memmap:
    """Map one field; nothing but the header is read until it is indexed."""
    if not path.is_file():
        raise DataError(
            f"NpyDataset field file {path} does not exist.",
            hint="check the path, or the folder the .npy files were written to",
        )
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as error:
        raise DataError(
            f"NpyDataset cannot read {path} as a .npy file: {error}",
            hint="write the field with numpy.save (or convert a CSV with stoker data convert)",
        ) from error
    if not isinstance(array, np.ndarray):
        raise DataError(
            f"NpyDataset field file {path} is a .npz archive; expected one .npy file per field.",
            hint="save each array on its own with numpy.save",
        )
    if array.ndim == 0 or array.dtype.kind not in "biufc":
        what = "a scalar (0-d)" if array.ndim == 0 else f"of dtype {array.dtype}"
        raise DataError(
            f"NpyDataset field file {path} holds an array {what}; expected numbers with "
            "one row per sample.",
            hint="save a numeric array whose first dimension indexes the samples",
        )
    return array


def _native(rows: np.ndarray) -> np.ndarray:
    native = rows.dtype.newbyteorder("=")
    return rows if rows.dtype == native else rows.astype(native)
