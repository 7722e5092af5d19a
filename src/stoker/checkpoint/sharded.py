"""Sharded weights in a checkpoint: every rank writes its own shard (torch.distributed.checkpoint).

Under FSDP no process holds the whole model, and gathering it on rank 0's CPU to save
does not scale past one host's memory. So every rank writes its shard of the model and
optimizer state with ``torch.distributed.checkpoint`` (DCP) into the ``shards/`` folder
of the checkpoint being written, before rank 0 writes ``state.pt``. The checkpoint is
the usual one: written under a temporary name, renamed whole, with a manifest and a
completion marker. ``state.pt`` (hashed by the manifest) lists every shard file with its
size and SHA-256, so a damaged shard is named before anything is loaded, and the chain
marker → manifest → state.pt → shards covers every byte.
"""

from __future__ import annotations

import hashlib
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

    dcp.save(state, checkpoint_id=folder / SHARDS_DIR)


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
