"""Fingerprints of files, and the Fingerprint record: hashlib and os only, no torch.

Split from :mod:`stoker.data.fingerprint` so that ``stoker data inspect`` can print the
same digest a training run records for file-backed data without importing torch (about
two seconds of start-up). The array and sample fingerprints stay there.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from stoker.errors import DataError

FingerprintKind = Literal["files", "arrays", "samples", "unknown"]
FingerprintMode = Literal["fast", "full"]
FINGERPRINT_FILE = "data_fingerprint.json"

_KINDS: tuple[str, ...] = ("files", "arrays", "samples", "unknown")
_MODES: tuple[str, ...] = ("fast", "full")
# Changing how digests are computed must change this, so old and new never compare equal.
_VERSION = b"stoker-fingerprint-v1"
_BLOCK_BYTES = 64 * 1024
_BLOCKS_PER_FILE = 16
_CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Fingerprint:
    """What a dataset held when a run started.

    Attributes:
        digest: SHA-256 hex digest of the content (64 characters).
        kind: What was hashed: ``files``, ``arrays``, ``samples``, or ``unknown`` for a
            stream that cannot be fingerprinted (it never matches by content).
        mode: ``fast`` (sampled) or ``full`` (every byte or sample).
        num_samples: Number of samples, when known.
        size_bytes: Total size of the files or arrays, when known.
        files: Number of files, for file-backed data.
    """

    digest: str
    kind: FingerprintKind
    mode: FingerprintMode
    num_samples: int | None = None
    size_bytes: int | None = None
    files: int | None = None

    @property
    def short(self) -> str:
        """The first 16 hex characters of the digest, for people."""
        return self.digest[:16]

    def describe(self) -> str:
        """One line for people: ``1a2b… (files, fast): 50000 samples, 1.2 GiB in 3 files``."""
        if self.kind == "unknown":
            return f"unknown ({self.mode}): the data could not be fingerprinted"
        parts = []
        if self.num_samples is not None:
            parts.append(f"{self.num_samples} samples")
        if self.size_bytes is not None:
            size = _format_bytes(self.size_bytes)
            if self.files is not None:
                size += f" in {self.files} file" + ("" if self.files == 1 else "s")
            parts.append(size)
        details = ", ".join(parts) or "size unknown"
        return f"{self.short} ({self.kind}, {self.mode}): {details}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (str, int, None) for JSON and ``torch.load(weights_only=True)``."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Fingerprint:
        """Rebuild a fingerprint from :meth:`to_dict` output.

        Raises:
            DataError: A key is missing or has a value of the wrong type.
        """
        counts = [data.get(key) for key in ("num_samples", "size_bytes", "files")]
        valid = (
            isinstance(data.get("digest"), str)
            and data.get("kind") in _KINDS
            and data.get("mode") in _MODES
            and all(value is None or isinstance(value, int) for value in counts)
        )
        if not valid:
            raise DataError(
                f"a saved data fingerprint is malformed: {dict(data)!r}; expected a hex digest, "
                f"kind in {_KINDS}, mode in {_MODES} and integer (or null) counts.",
                hint="delete the saved fingerprint to skip the check, or resume with "
                "--allow-data-change",
            )
        return cls(data["digest"], data["kind"], data["mode"], *counts)


def _format_bytes(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    power = min((size.bit_length() - 1) // 10, 4)
    return f"{size / 1024**power:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"


def _hasher(kind: str, mode: str) -> Any:
    hasher = hashlib.sha256(_VERSION)
    hasher.update(f"|{kind}|{mode}|".encode())
    return hasher


def _update_int(hasher: Any, value: int | None) -> None:
    hasher.update(b"none|" if value is None else f"{value}|".encode())


# ---------------------------------------------------------------- files


def _walk(root: str) -> Iterator[tuple[str, str]]:
    """``(path, name relative to root with /)`` of the files under ``root``, in sorted
    order, skipping hidden ones (``.git``, ``.DS_Store``). Strings, not ``Path``
    objects: for thousands of small files, building paths cost more than reading them."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        inner = os.path.relpath(folder, root)
        prefix = "" if inner == "." else inner.replace(os.sep, "/") + "/"
        for name in sorted(names):
            if not name.startswith("."):
                yield os.path.join(folder, name), prefix + name


def _as_paths(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(paths, str | os.PathLike):
        return [Path(paths)]
    return [Path(p) for p in paths]


def _file_digest(file: str, size: int, *, full: bool) -> bytes:
    if size <= _CHUNK_BYTES:
        # A small file in one read (os.read, no file object): most image datasets.
        descriptor = os.open(file, os.O_RDONLY)
        try:
            data = os.read(descriptor, size + 1)  # a short read is the end of the file
            if len(data) > size:  # it grew since it was measured: read it to the end
                while more := os.read(descriptor, _CHUNK_BYTES):
                    data += more
        finally:
            os.close(descriptor)
        return hashlib.sha256(data).digest()
    hasher = hashlib.sha256()
    with open(file, "rb", buffering=0) as handle:
        if full or size <= _BLOCK_BYTES * _BLOCKS_PER_FILE:
            buffer = bytearray(_CHUNK_BYTES)
            view = memoryview(buffer)
            while count := handle.readinto(buffer):
                hasher.update(view[:count])
        else:
            # Fixed positions (first block, last block, evenly spaced between) make the
            # digest depend only on the bytes, and reading 1 MiB keeps any size fast.
            last = size - _BLOCK_BYTES
            for i in range(_BLOCKS_PER_FILE):
                offset = i * last // (_BLOCKS_PER_FILE - 1)
                hasher.update(os.pread(handle.fileno(), _BLOCK_BYTES, offset))
    return hasher.digest()


def fingerprint_files(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    *,
    full: bool = False,
    num_samples: int | None = None,
) -> Fingerprint:
    """Fingerprint files and folders by their names, sizes and content.

    Folders are walked in sorted order, skipping hidden entries. Names enter the digest
    relative to the deepest folder that holds every given path, so moving or renaming
    that folder does not change the fingerprint, while renaming a file inside it does.

    Args:
        paths: A file or folder, or several (their order counts).
        full: Hash every byte instead of 16 sampled 64 KiB blocks per file.
        num_samples: The number of samples, when known; it enters the digest.

    Returns:
        A fingerprint of kind ``files``.

    Raises:
        DataError: A path does not exist, or no files were found.
    """
    given = [p.resolve() for p in _as_paths(paths)]
    missing = [str(p) for p in given if not p.exists()]
    if missing:
        raise DataError(
            f"cannot fingerprint {', '.join(missing)}: no such file or folder.",
            hint="check the data path in the config (data.path)",
        )
    base = Path(os.path.commonpath(given))
    if not base.is_dir():
        base = base.parent
    files: list[tuple[str, str]] = []  # (path, name relative to base)
    for path in given:
        relative = path.relative_to(base).as_posix()
        if path.is_dir():
            prefix = "" if relative == "." else relative + "/"
            files.extend((file, prefix + name) for file, name in _walk(str(path)))
        else:
            files.append((str(path), relative))
    if not files:
        raise DataError(
            f"cannot fingerprint {', '.join(map(str, given))}: the folders hold no files.",
            hint="check the data path in the config (data.path)",
        )
    hasher = _hasher("files", "full" if full else "fast")
    _update_int(hasher, num_samples)
    total = 0
    for file, name in files:
        size = os.stat(file).st_size
        total += size
        hasher.update(name.encode() + b"\0")
        _update_int(hasher, size)
        hasher.update(_file_digest(file, size, full=full))
    mode: FingerprintMode = "full" if full else "fast"
    return Fingerprint(hasher.hexdigest(), "files", mode, num_samples, total, len(files))
