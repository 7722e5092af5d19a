"""Exporting model weights to .safetensors and loading them back."""

from __future__ import annotations

import os
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn

from stoker.checkpoint.io import _umask, atomic_path, listing_hint
from stoker.errors import CheckpointError

__all__ = ["export_safetensors", "load_safetensors_into", "unwrap_model"]


def model_wrappers(model: nn.Module) -> list[nn.Module]:
    """The torch.compile and (Distributed)DataParallel wrappers around the user's model,
    outermost first (empty for a plain model)."""
    found = []
    while True:
        # torch.compile's OptimizedModule keeps the user's module as `_orig_mod`: the one
        # private attribute read here, with a plain module as the fallback.
        inner = getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            is_parallel = isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel)
            inner = model.module if is_parallel else None
        if inner is None:
            return found
        found.append(model)
        model = inner


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strips torch.compile and (Distributed)DataParallel wrappers, so keys match the model."""
    wrappers = model_wrappers(model)
    return _inner(wrappers[-1]) if wrappers else model


def _inner(wrapper: nn.Module) -> nn.Module:
    inner = getattr(wrapper, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else wrapper.module


def export_safetensors(
    model: nn.Module, path: str | Path, *, state: dict[str, torch.Tensor] | None = None
) -> Path:
    """Writes the model's weights (parameters and persistent buffers) as a .safetensors file.

    Tied (shared) tensors are stored once, and wrapper prefixes (``_orig_mod.``,
    ``module.``) are stripped, so the file loads into the plain model. The write is atomic.

    Args:
        model: The model, possibly wrapped by torch.compile or DDP.
        path: The file to write; its folder must exist.
        state: The whole state dict, when the model's own holds only this rank's shards
            (FSDP gathers it); tensors sharing storage are then stored once.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        CheckpointError: The file could not be written.
    """
    path = Path(path)
    with atomic_path(path, what="safetensors file") as tmp:
        # "format": "pt" is the metadata other safetensors readers expect from PyTorch files.
        if state is None:
            safetensors.torch.save_model(unwrap_model(model), str(tmp), metadata={"format": "pt"})
        else:
            safetensors.torch.save_file(_once_each(state), str(tmp), metadata={"format": "pt"})
        _default_mode(tmp)
    return path


def _default_mode(path: Path) -> None:
    """Give ``path`` the mode any new file gets (0644 under umask 022).

    safetensors writes its own private (0600) file over the one ``atomic_path`` made, so the
    exported weights came out unreadable to the group that shares the run dir.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if os.chmod in os.supports_fd:
            os.fchmod(fd, 0o666 & ~_umask())
        else:  # Windows: no fchmod, and the mode is only the read-only bit anyway
            os.chmod(path, 0o666 & ~_umask())
    finally:
        os.close(fd)


def _once_each(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the second name of a tensor tied to another (safetensors refuses shared storage)."""
    kept: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            kept[name] = tensor.contiguous()
    return kept


def load_safetensors_into(
    model: nn.Module, path: str | Path, *, strict: bool = True
) -> tuple[list[str], list[str]]:
    """Loads a .safetensors file into ``model`` in place.

    Args:
        model: The model to fill, possibly wrapped by torch.compile or DDP.
        path: The .safetensors file.
        strict: Whether keys missing from, or unexpected in, the file are an error.

    Returns:
        The missing and the unexpected keys (both empty when ``strict``).

    Raises:
        CheckpointError: The file is missing, its header is broken, or it does not fit the
            model.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"Safetensors file {path} does not exist.",
            hint=listing_hint(path.parent, "*.safetensors", kind="safetensors files"),
        )
    try:
        missing, unexpected = safetensors.torch.load_model(unwrap_model(model), path, strict)
    except SafetensorError as exc:
        raise CheckpointError(
            f"Safetensors file {path} is broken (truncated or not safetensors): {exc}.",
            hint="export the weights again with export_safetensors",
        ) from exc
    except OSError as exc:
        raise CheckpointError(f"Cannot read safetensors file {path}: {exc}.") from exc
    except RuntimeError as exc:
        # load_state_dict reports missing/unexpected keys and shape mismatches this way.
        hint = "build the same architecture the weights were exported from"
        if "size mismatch" not in str(exc):
            hint += ", or pass strict=False to load only the keys that match"
        raise CheckpointError(
            f"Safetensors file {path} does not fit {type(unwrap_model(model)).__name__}: {exc}",
            hint=hint,
        ) from exc
    return sorted(missing), sorted(unexpected)
