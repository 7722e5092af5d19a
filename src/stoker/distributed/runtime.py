"""The process group of one run: started from torchrun's environment, DDP/FSDP wrapping,
and the few collectives the rest of stoker needs (gather to rank 0, broadcast, sums)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from stoker.config import DistributedConfig
from stoker.distributed.env import RankInfo
from stoker.errors import ConfigError

logger = logging.getLogger("stoker")

T = TypeVar("T")


class Distributed:
    """One process's view of the job; with a world of 1 every collective is a no-op.

    Two process groups: the default one (NCCL on CUDA, gloo on CPU) carries gradients
    and metric sums; a second gloo group carries small control messages (has every rank
    a batch? did a rank get SIGTERM?) on the CPU, so they never add a CUDA sync.
    """

    def __init__(self, info: RankInfo, *, timeout_s: float, backend: str | None = None) -> None:
        self.info = info
        self.timeout_s = timeout_s
        self.backend = backend
        self.control: Any = None  # the gloo group for control messages
        self.saves: Any = None  # the gloo group of asynchronous checkpoint writes, once made
        self.owns_group = False  # whether start() made the default group (and so ends it)

    @property
    def rank(self) -> int:
        """This process's rank (0 in one process)."""
        return self.info.rank

    @property
    def world_size(self) -> int:
        """How many processes train (1 in one process)."""
        return self.info.world_size

    @property
    def enabled(self) -> bool:
        """True with more than one process; else every collective is a no-op."""
        return self.info.distributed

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and writes files."""
        return self.info.is_main

    # --- life cycle ---------------------------------------------------------------------

    @classmethod
    def start(cls, config: DistributedConfig, *, device_name: str) -> Distributed:
        """Join the process group torchrun set up the environment for (nothing in one process)."""
        info = RankInfo.from_environ()
        if not info.distributed:
            return cls(info, timeout_s=config.timeout_s)
        backend = _backend(config.backend, device_name)
        if backend == "nccl":
            torch.cuda.set_device(info.local_rank)
        timeout = timedelta(seconds=config.timeout_s)
        started = cls(info, timeout_s=config.timeout_s, backend=backend)
        if not dist.is_initialized():  # else: stoker.fit inside the user's own group
            started.owns_group = True
            dist.init_process_group(
                backend=backend,
                store=_attempt_store(info, timeout),
                rank=info.rank,
                world_size=info.world_size,
                timeout=timeout,
            )
        started.control = dist.new_group(backend="gloo", timeout=timeout)
        logger.debug("rank %d of %d joined (%s)", info.rank, info.world_size, backend)
        return started

    def close(self) -> None:
        """Leave the process group (every rank, at the end of the run).

        A group the caller made before the run stays theirs: only the control group goes.
        The references go too: a group lives, with its native threads, as long as anything
        holds it, and one still alive while the interpreter exits can abort the process
        (a restarted torchrun group lost a rank to SIGABRT that way).
        """
        groups, self.control, self.saves = (self.control, self.saves), None, None
        if not (self.enabled and dist.is_initialized()):
            return
        if self.owns_group:
            dist.destroy_process_group()
            return
        for group in groups:
            if group is not None:
                dist.destroy_process_group(group)

    def save_group(self) -> Any:
        """The gloo group asynchronous checkpoint writes talk over (made at the first).

        Their messages come from a background thread while training's go on: on a group
        of their own the two never interleave. A collective (every rank asks at once).
        """
        if self.saves is None:
            self.saves = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self.saves

    # --- collectives ----------------------------------------------------------------------

    def barrier(self) -> None:
        """Wait until every rank is here (a no-op in one process)."""
        if self.enabled:
            dist.barrier(group=self.control)

    def gather(self, value: T) -> list[T] | None:
        """Every rank's ``value`` on rank 0 (in rank order); None on the other ranks."""
        if not self.enabled:
            return [value]
        gathered: list[Any] | None = [None] * self.world_size if self.is_main else None
        dist.gather_object(value, gathered, dst=0, group=self.control)
        return gathered

    def all_gather(self, value: T) -> list[T]:
        """Every rank's ``value`` on every rank (small plain data only)."""
        if not self.enabled:
            return [value]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=self.control)
        return gathered

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank."""
        if not self.enabled:
            return value
        box = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]  # type: ignore[return-value]

    def control_sum(self, values: list[int]) -> list[int]:
        """Element-wise sum of small integers over the ranks, on the CPU (gloo)."""
        if not self.enabled:
            return values
        tensor = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(tensor, group=self.control)
        return tensor.tolist()

    def agree_finite(self) -> Callable[[bool, bool], tuple[bool, bool]] | None:
        """Combines each rank's (loss finite, gradients finite) into the same verdict for all.

        Under DDP the gradients are already the same on every rank, but a loss is each
        rank's own, and under FSDP each rank checks only its shard of the gradients.
        """
        if not self.enabled:
            return None

        def agree(loss_ok: bool, grads_ok: bool) -> tuple[bool, bool]:
            bad_loss, bad_grads = self.control_sum([int(not loss_ok), int(not grads_ok)])
            return bad_loss == 0, bad_grads == 0

        return agree

    # --- the model ------------------------------------------------------------------------

    def wrap(
        self, model: nn.Module, config: DistributedConfig, *, device: torch.device
    ) -> nn.Module:
        """The model as the step calls it: DDP or FSDP2 with several ranks, else as is.

        Build the optimizer after this: FSDP2 replaces the parameters with sharded ones.
        """
        if not self.enabled:
            return model
        if config.strategy == "fsdp":
            from stoker.distributed.fsdp import shard_model

            return shard_model(model, device=device, world_size=self.world_size)
        return _DataParallel(
            model,
            device_ids=[device.index or self.info.local_rank] if device.type == "cuda" else None,
            find_unused_parameters=config.find_unused_parameters,
        )

    def weights_io(
        self,
        config: DistributedConfig,
        *,
        checkpoints: Path | None = None,
        async_save: bool = False,
    ) -> Any:
        """How checkpoints write and load the weights: each rank its shard under FSDP
        (read back from the ``checkpoints`` folder; in the background with ``async_save``)."""
        if self.enabled and config.strategy == "fsdp":
            from stoker.distributed.fsdp import ShardedWeights

            return ShardedWeights(self, checkpoints=checkpoints, async_save=async_save)
        if async_save:
            logger.warning(
                "checkpoint.async_save applies to FSDP runs only (distributed.strategy=fsdp "
                "on 2 or more processes); this run saves its checkpoints synchronously"
            )
        from stoker.train.resume import PlainWeights

        return PlainWeights()

    def no_sync(self, wrapped: nn.Module) -> Callable[[], contextlib.AbstractContextManager] | None:
        """The context for micro-batches that only accumulate (no gradient communication)."""
        if not self.enabled:
            return None
        if isinstance(wrapped, DistributedDataParallel):
            return wrapped.no_sync
        from stoker.distributed.fsdp import gradient_sync_off, is_sharded

        if is_sharded(wrapped):
            return lambda: gradient_sync_off(wrapped)
        return None


class _DataParallel(DistributedDataParallel):
    """DDP that runs the plain module when no gradient is recorded (validation).

    DDP's own forward may broadcast buffers (BatchNorm's running stats) from rank 0, a
    collective: with ranks validating different numbers of batches it would hang.
    """

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.module(*inputs, **kwargs)
        return super().forward(*inputs, **kwargs)


def _attempt_store(info: RankInfo, timeout: timedelta) -> dist.Store:
    """The rendezvous store torchrun points at, under a prefix of its own per restart.

    torchrun's agent keeps one store across restarts, so the keys of a failed attempt
    (the old ranks' addresses) would still be there for the new one to connect to.
    """
    try:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ConfigError(
            f"WORLD_SIZE={info.world_size} but MASTER_ADDR/MASTER_PORT are not set",
            hint="launch with `stoker train --nproc N` or torchrun, which set them",
        ) from None
    # Under torchrun the agent hosts the store; launched by hand, rank 0 does.
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host,
        port,
        info.world_size,
        is_master=not agent_hosts and info.rank == 0,
        timeout=timeout,
        multi_tenant=not agent_hosts,
    )
    return dist.PrefixStore(f"stoker/attempt_{info.restart_count}/", store)


def _backend(setting: str, device_name: str) -> str:
    wants_cuda = device_name.startswith("cuda") or (
        device_name == "auto" and torch.cuda.is_available()
    )
    if setting == "auto":
        return "nccl" if wants_cuda else "gloo"
    if setting == "nccl" and not torch.cuda.is_available():
        raise ConfigError(
            "distributed.backend=nccl needs CUDA GPUs; this machine has none",
            hint="set distributed.backend=auto (gloo on CPU)",
        )
    return setting


@contextlib.contextmanager
def distributed_run(config: DistributedConfig, *, device_name: str) -> Iterator[Distributed]:
    """A process group for the length of one run, left again however the run ends."""
    session = Distributed.start(config, device_name=device_name)
    try:
        yield session
    finally:
        session.close()
