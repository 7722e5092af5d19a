"""Choosing the training device and moving (nested) batches onto it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

from stoker.errors import ConfigError

__all__ = ["move_to_device", "resolve_device"]


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def resolve_device(spec: str = "auto") -> torch.device:
    """The device named by ``spec``, checked to exist on this machine.

    Args:
        spec: ``"auto"`` (CUDA, else MPS, else CPU), or a torch device string such as
            ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or ``"mps"``.

    Returns:
        The device.

    Raises:
        ConfigError: An unknown device string, or a device this machine does not have.
    """
    text = str(spec).strip().lower()
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if _mps_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as error:
        raise ConfigError(
            f"train.device={spec!r} is not a device; expected auto, cpu, cuda, cuda:N or mps.",
            hint="set train.device=auto",
        ) from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"train.device={spec!r} asks for CUDA, but CUDA is not available on this "
                f"machine (torch {torch.__version__}, built with CUDA {torch.version.cuda}).",
                hint="set train.device=auto or train.device=cpu",
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ConfigError(
                f"train.device={spec!r} asks for GPU {device.index}, but this machine has "
                f"{count} GPU(s) (cuda:0 to cuda:{count - 1}).",
                hint="set train.device=cuda:0 or train.device=auto",
            )
    elif device.type == "mps" and not _mps_available():
        raise ConfigError(
            f"train.device={spec!r} asks for Apple MPS, which is not available on this machine.",
            hint="set train.device=auto or train.device=cpu",
        )
    return device


def move_to_device(batch: Any, device: str | torch.device, *, non_blocking: bool = True) -> Any:
    """Move every tensor inside ``batch`` to ``device``, keeping the structure.

    Tuples, lists, dicts and namedtuples are walked recursively and rebuilt with their
    own type; anything that is not a tensor is returned unchanged. A container whose
    tensors are all already on ``device`` is returned as is (no copy).

    Args:
        batch: A tensor or a nested container of tensors.
        device: Target device.
        non_blocking: Let host-to-device copies overlap with compute (effective from
            pinned memory). Never used for copies to the CPU, whose data the caller
            would read before the copy finished.

    Returns:
        The batch on ``device``.
    """
    target = torch.device(device)
    # A non-blocking copy to the host returns before the data has arrived.
    return _move(batch, target, non_blocking and target.type != "cpu")


def _move(obj: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, tuple):
        items = [_move(item, device, non_blocking) for item in obj]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            return obj
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items) if type(obj) is not tuple else tuple(items)
    if isinstance(obj, list):
        items = [_move(item, device, non_blocking) for item in obj]
        if all(new is old for new, old in zip(items, obj, strict=True)):
            return obj
        return items if type(obj) is list else type(obj)(items)
    if isinstance(obj, Mapping):
        moved = {key: _move(value, device, non_blocking) for key, value in obj.items()}
        if all(moved[key] is value for key, value in obj.items()):
            return obj
        try:
            # A Mapping subclass (dict, OrderedDict...) takes its items; abstract Mapping's
            # constructor says nothing of that, hence the cast.
            return cast("Callable[[dict[Any, Any]], Any]", type(obj))(moved)
        except TypeError:
            # Mappings whose constructor takes other arguments (e.g. defaultdict).
            return moved
    return obj
