"""Parquet files: importing pyarrow, and the files a path names. No torch.

Split from :mod:`stoker.data.parquet` so that ``stoker data inspect`` can read Parquet
metadata and rows without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from stoker.errors import ConfigError, DataError


def require_pyarrow(what: str) -> tuple[ModuleType, ModuleType]:
    """Import ``pyarrow`` and ``pyarrow.parquet``, or say how to install them.

    Not ``pyarrow.compute``: its wrappers cost ~10 MiB of RSS, and the casts that need
    it (``ChunkedArray.cast``, ``fill_null``) import it themselves when a file has such
    columns.

    Raises:
        ConfigError: pyarrow is not installed; the hint names the ``parquet`` extra.
    """
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as error:
        raise ConfigError(
            f"{what} needs pyarrow, which is not installed.",
            hint="pip install 'stoker[parquet]'",
        ) from error
    return pyarrow, pyarrow.parquet


def _parquet_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.parquet"), key=lambda p: p.name)
        if not files:
            raise DataError(
                f"Parquet folder {path} holds no *.parquet files.",
                hint="point data.path at a .parquet file or a folder of them",
            )
        return files
    if not path.is_file():
        raise DataError(
            f"Parquet path {path.absolute()} does not exist; expected a .parquet file or a "
            "folder of them.",
            hint="check the path: in a run config a relative path is taken from the config "
            "file's folder, in stoker.fit from the working directory",
        )
    return [path]
