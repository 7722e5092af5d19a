"""Sharded weights in a checkpoint: every rank writes its own shard (torch.distributed.checkpoint).

Under FSDP no process holds the whole model, and gathering it on rank 0's CPU to save
does not scale past one host's memory. So every rank writes its shard of the model and
optimizer state with ``torch.distributed.checkpoint`` (DCP) into the ``shards/`` folder
of the checkpoint being written, before rank 0 writes ``state.pt``. The checkpoint is
the usual one: written under a temporary name, renamed whole, with a manifest and a
completion marker. ``state.pt`` (hashed by the manifest) lists every shard file with its
size and SHA-256, so a damaged shard is named before anything is loaded, and the chain
marker → manifest → state.pt → shards covers every byte.

With ``checkpoint.async_save`` the shards are written by ``dcp.async_save``: it copies
each rank's shards to CPU memory before returning (so the next optimizer step cannot
change what is written) and writes them in a background thread; :func:`shards_written`
waits for that. The rest of the checkpoint (state.pt, manifest, marker) is written only
after, so an unfinished write is never a checkpoint.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from stoker.checkpoint.io import fsync_dir

__all__ = [
    "SHARDED",
    "SHARDS_DIR",
    "check_shards",
    "is_sharded_entry",
    "list_shards",
    "read_shards",
    "shards_written",
    "start_writing_shards",
    "write_shards",
]

#: The folder of a checkpoint that holds the shards.
SHARDS_DIR = "shards"
#: The key of ``state["model"]`` that says the weights are in shards, not in state.pt.
SHARDED = "sharded_weights"

_CHUNK = 1 << 20


def is_sharded_entry(entry: Any) -> bool:
    """Whether a bundle's ``model`` entry points at shards rather than holding tensors."""
    return isinstance(entry, dict) and isinstance(entry.get(SHARDED), dict)


def write_shards(folder: Path, state: dict[str, Any]) -> None:
    """Every rank writes its part of ``state`` (sharded state dicts) into ``folder/shards``.

    A collective: every rank calls it with its own shards, and it returns on each once all
    have written (DCP fsyncs each file; rank 0 writes DCP's metadata).
    """
    # Imported here: DCP pulls in DTensor and sympy (~1 s of CPU), which every training
    # process would pay at start (the loop imports this module) for FSDP runs only.
    import torch.distributed.checkpoint as dcp

    try:
        dcp.save(state, checkpoint_id=folder / SHARDS_DIR)
    except dcp.CheckpointException as exc:
        raise _write_failure(exc) from exc


def start_writing_shards(folder: Path, state: dict[str, Any], *, group: Any) -> Future:
    """:func:`write_shards` in the background: returns once ``state`` is copied to CPU.

    A collective, as :func:`write_shards`, but its cross-rank messages go over ``group``
    (a gloo group of its own: the writing thread must not interleave its messages with
    the training's on the default group). Pass the future to :func:`shards_written`.
    """
    import torch.distributed.checkpoint as dcp  # only FSDP runs need it (see write_shards)

    future = dcp.async_save(state, checkpoint_id=folder / SHARDS_DIR, process_group=group)
    assert isinstance(future, Future), "the default stager copies before async_save returns"
    return future


def shards_written(future: Future) -> None:
    """Waits until every rank wrote its shards (DCP's write ends with a collective).

    Raises:
        OSError: A rank could not write (a full disk, a read-only file system), as
            :func:`write_shards` raises it.
    """
    import torch.distributed.checkpoint as dcp

    try:
        future.result()
    except dcp.CheckpointException as exc:
        raise _write_failure(exc) from exc


def _write_failure(exc: BaseException) -> Exception:
    """The error behind DCP's ``CheckpointException`` (which is no ``Exception``, and lists
    every rank's failure with its traceback): the first rank's OSError, so a full disk is
    named as one, else a RuntimeError naming the rank and what went wrong."""
    failures = sorted((getattr(exc, "failures", None) or {}).items())
    for _rank, (error, _trace) in failures:
        if isinstance(error, OSError):
            return error
    if failures:
        rank, (error, _trace) = failures[0]
        return RuntimeError(
            f"rank {rank} could not write its shard: {type(error).__name__}: {error}"
        )
    return RuntimeError(f"writing the shards failed: {exc!r}")


def list_shards(folder: Path) -> dict[str, dict[str, Any]]:
    """``{file: {"bytes", "sha256"}}`` of the shards, after every rank wrote (rank 0)."""
    shards = folder / SHARDS_DIR
    fsync_dir(shards)
    return {path.name: _record(path) for path in sorted(shards.iterdir())}


def _record(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def check_shards(
    folder: Path, files: dict[str, dict[str, Any]], *, part: tuple[int, int]
) -> str | None:
    """What is wrong with this rank's share of the shard files (None: nothing).

    ``part`` is ``(rank, world_size)``: rank r hashes every world_size-th file from r, so
    the ranks together read each file once. Returned, not raised, so that every rank can
    learn every other's verdict before the collective load (which would otherwise hang).
    """
    shards = folder / SHARDS_DIR
    if not shards.is_dir() or shards.is_symlink():
        return f"{shards} is missing or not a folder"
    rank, world = part
    for name in sorted(files)[rank::world]:
        path = shards / name
        if path.is_symlink() or not path.is_file():
            return f"{SHARDS_DIR}/{name} is missing or not a regular file"
        actual = _record(path)
        if actual != files[name]:
            return (
                f"{SHARDS_DIR}/{name} was altered or truncated: {actual['bytes']} bytes, "
                f"SHA-256 {actual['sha256'][:16]}…; state.pt records {files[name]['bytes']} "
                f"bytes, {str(files[name]['sha256'])[:16]}…"
            )
    return None


def read_shards(folder: Path, state: dict[str, Any]) -> None:
    """Fill the sharded ``state`` in place from ``folder/shards`` (a collective)."""
    import torch.distributed.checkpoint as dcp  # only FSDP runs need it (see write_shards)

    dcp.load(state, checkpoint_id=folder / SHARDS_DIR)
