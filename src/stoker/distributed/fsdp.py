"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state split across ranks.

For models whose weights, gradients and Adam state do not fit one device. The model is
sharded in place (its parameters become DTensors), so the optimizer must be built after
:func:`shard_model`, and whole (unsharded) state dicts are gathered for checkpoints and
the exported weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

_WHOLE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def shard_model(model: nn.Module, *, device: torch.device, world_size: int) -> nn.Module:
    """Shard ``model`` in place: each block its own unit, then the root.

    Blocks are the members of every ``nn.ModuleList`` (a transformer's layers); a model
    without one has its top-level children with parameters sharded one by one. Each
    unit's parameters are gathered just before its forward and freed after it.
    """
    mesh = init_device_mesh(device.type, (world_size,))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _blocks(model: nn.Module) -> list[nn.Module]:
    in_lists = [
        block
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for block in module
        if any(True for _ in block.parameters())
    ]
    if in_lists:
        return in_lists
    return [child for child in model.children() if any(True for _ in child.parameters())]


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gradient_sync_off(model: nn.Module) -> Iterator[None]:
    """Accumulate gradients locally (no reduce-scatter) for a non-final micro-batch."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


class ShardedWeights:
    """Whole state dicts from a sharded model: gathered on every rank, kept on rank 0's CPU."""

    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """A collective: every rank must call it; rank 0 gets the whole dicts."""
        return (
            get_model_state_dict(model, options=_WHOLE),
            get_optimizer_state_dict(model, optimizer, options=_WHOLE),
        )

    def export_state(self, model: nn.Module) -> dict:
        """The whole weights alone, for ``model.safetensors`` (a collective)."""
        return get_model_state_dict(model, options=_WHOLE)

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
    ) -> None:
        """Every rank loads the whole dicts (read from the checkpoint) and keeps its shard."""
        whole = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=whole)
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=whole)
