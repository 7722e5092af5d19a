"""FSDP2 (``fully_shard``): parameters, gradients and optimizer state split across ranks.

For models whose weights, gradients and Adam state do not fit one device. The model is
sharded in place (its parameters become DTensors), so the optimizer must be built after
:func:`shard_model`. Checkpoints hold every rank's shard (:class:`ShardedWeights`); whole
(unsharded) tensors are gathered only for the exported weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
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

from stoker.checkpoint.io import os_error
from stoker.checkpoint.manifest import DamagedCheckpointError
from stoker.checkpoint.sharded import (
    SHARDED,
    check_shards,
    is_sharded_entry,
    list_shards,
    read_shards,
    shards_written,
    start_writing_shards,
    write_shards,
)
from stoker.errors import CheckpointError

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
    """True when ``model`` was sharded by FSDP2 (``fully_shard``)."""
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
    """The weights of a sharded model in checkpoints: each rank writes and reads its shard.

    Checkpoints hold the weights as every rank's shard, written with
    ``torch.distributed.checkpoint`` inside the checkpoint folder (see
    :mod:`stoker.checkpoint.sharded`): no process ever holds the whole model. Only the
    exported ``model.safetensors`` gathers whole tensors, once, at the end. A checkpoint
    of whole dicts (written before sharded checkpoints) still loads.
    """

    def __init__(
        self, dist: Any = None, *, checkpoints: Path | None = None, async_save: bool = False
    ) -> None:
        """``dist``: the run's Distributed (its collectives); ``checkpoints``: the folder
        a resumed bundle's shards are read from; ``async_save``: write the shards in the
        background (``checkpoint.async_save``), the step waits only for their CPU copy."""
        self.dist = dist
        self.checkpoints = checkpoints
        self.async_save = async_save
        self._writing: tuple[Path, Future] | None = None  # this rank's shards, being written

    @property
    def pending(self) -> bool:
        """Whether an asynchronous save is under way (on every rank alike)."""
        return self._writing is not None

    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """Stand-ins: the shards are written by :meth:`write_first` during the save."""
        return {SHARDED: {}}, {SHARDED: {}}

    def write_first(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> Callable[[Path, str], Any]:
        """Rank 0's part of a save: tell the ranks the folder, write with them, list it.

        Asynchronously, the checkpoint gets a callable instead of the listing: it waits
        for every rank's shards (in the checkpointer's thread), then lists them.
        """

        def entries(temp: Path, name: str) -> dict[str, Any]:
            entry = {SHARDED: {"checkpoint": name, "files": list_shards(temp)}}
            return {"model": entry, "optimizer": {SHARDED: {"checkpoint": name}}}

        def write(temp: Path, name: str) -> Any:
            self.dist.broadcast(str(temp))
            if not self._write(temp, model, optimizer):
                return entries(temp, name)
            future = self._writing[1]  # type: ignore[index]

            def written() -> dict[str, Any]:
                shards_written(future)
                return entries(temp, name)

            return written

        return write

    def join_write(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The other ranks' part of a save: write their shards where rank 0 says."""
        self._write(Path(self.dist.broadcast(None)), model, optimizer)

    def _write(self, temp: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> bool:
        """Writes this rank's shards into ``temp``; True if they are still being written."""
        state = _sharded_state(model, optimizer)
        if not self.async_save:
            write_shards(temp, state)
            return False
        self._writing = temp, start_writing_shards(temp, state, group=self.dist.save_group())
        return True

    def settle(self, checkpointer: Any = None) -> Path | None:
        """Finishes the pending asynchronous save on every rank (a collective).

        Rank 0 passes its Checkpointer, whose thread waits for the shards and then writes
        state.pt, manifest and marker; the other ranks wait for their own shards. Returns
        the checkpoint now complete (rank 0), or None.

        Raises:
            CheckpointError: The save failed on some rank: every rank raises the first
                rank's error (a full disk named as one); no marker was written.
        """
        if self._writing is None:
            return None
        (temp, future), self._writing = self._writing, None
        path = problem = None
        try:
            if checkpointer is not None:
                path = checkpointer.wait()
            else:
                shards_written(future)
        except CheckpointError as exc:
            problem = (exc.message, exc.hint)
        except OSError as exc:
            error = os_error(temp / "shards", "checkpoint shards", exc)
            problem = (error.message, error.hint)
        except Exception as exc:
            problem = (f"Could not write checkpoint shards: {type(exc).__name__}: {exc}", None)
        problems = [p for p in self.dist.all_gather(problem) if p]
        if problems:
            message, hint = problems[0]
            raise CheckpointError(message, hint=hint)
        return path

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
        """Every rank reads its shards (checked first, by all ranks together) and loads them.

        Whole dicts (an older checkpoint) are loaded by every rank, which keeps its shard.
        """
        if not is_sharded_entry(model_state):
            whole = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, model_state, options=whole)
            set_optimizer_state_dict(model, optimizer, optimizer_state, options=whole)
            return
        entry = model_state[SHARDED]
        assert self.checkpoints is not None, "a resumed FSDP run names its checkpoints folder"
        folder = self.checkpoints / entry["checkpoint"]
        problem = check_shards(folder, entry["files"], part=(self.dist.rank, self.dist.world_size))
        problems = [p for p in self.dist.all_gather(problem) if p]
        if problems:
            raise DamagedCheckpointError(folder, problems[0])
        state = _sharded_state(model, optimizer)
        read_shards(folder, state)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def _sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state (DTensors), as DCP saves them."""
    return {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optimizer),
    }
