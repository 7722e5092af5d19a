"""The resume bundle: everything a restart needs, saved and restored in one place.

A checkpoint holds the model, optimizer, scheduler, precision (scaler), counters,
clip statistics, best-so-far, bad-record counts, RNG states, config, data fingerprint
and, when written in the middle of an epoch, the loader position and the epoch's
running metrics. All of it is tensors and plain data, so it loads with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from stoker.checkpoint import Checkpointer
from stoker.checkpoint.sharded import is_sharded_entry
from stoker.data.fingerprint import Fingerprint
from stoker.data.records import BadRecordLog
from stoker.data.worker_watch import STOP_SIGNALS
from stoker.errors import CheckpointError, ConfigError
from stoker.train.callbacks import Callbacks
from stoker.train.grads import GradClipper
from stoker.train.loop import Loop, StopRequest
from stoker.train.precision import Precision
from stoker.train.resume_changes import (
    apply_hyperparameters,
    changed_keys,
    check_optimizer_class,
    config_changes,
    fresh_hyperparameters,
    weights_error,
)
from stoker.train.state import TrainState, capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from stoker.config import RunConfig

logger = logging.getLogger("stoker")


class PlainWeights:
    """The model's and optimizer's own state dicts (one process, or DDP's full copies).

    FSDP swaps in ``stoker.distributed.fsdp.ShardedWeights``, where each rank writes its
    shard during the save (``write_first`` on rank 0, ``join_write`` on the others).
    """

    def state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
        """The model's and the optimizer's whole state dicts (one process holds all of them)."""
        return model.state_dict(), optimizer.state_dict()

    def write_first(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to write beside state.pt."""
        return None

    def join_write(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Nothing for the ranks that do not write the checkpoint."""

    #: No save is ever under way: state.pt is written whole, before save() returns.
    pending = False

    def settle(self, checkpointer: Checkpointer | None = None) -> None:
        """Nothing to wait for (see ``ShardedWeights.settle``)."""

    def export_state(self, model: nn.Module) -> dict | None:
        """The weights to export, when the model's own state dict is not whole: None."""
        return None

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
    ) -> None:
        """Load the saved state dicts into the model and the optimizer."""
        if is_sharded_entry(model_state):
            raise CheckpointError(
                "this checkpoint holds the weights as the shards of an FSDP run "
                "(distributed.strategy=fsdp); this run does not shard the model.",
                hint="resume with distributed.strategy=fsdp and the same --nproc, or read "
                "the exported model.safetensors",
            )
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)


@dataclass
class ResumableParts:
    """The stateful pieces of one run, as ``train_run`` built them."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    state: TrainState
    clipper: GradClipper
    checkpointer: Checkpointer | None  # rank 0's alone in a distributed run
    bad_records: BadRecordLog
    train_loader: Any
    config: dict[str, Any]
    fingerprint: Fingerprint | None
    weights: Any = field(default_factory=PlainWeights)
    callbacks: Callbacks = field(default_factory=Callbacks)

    def rank_state(self, *, in_epoch: dict[str, Any] | None = None) -> dict[str, Any]:
        """What differs between ranks: RNG streams, loader position, the epoch's running sums."""
        loader = (
            self.train_loader.state_dict(batches_consumed=in_epoch["batches"])
            if in_epoch
            else {"epoch": self.state.epoch}
        )
        return {"rng": capture_rng_state(), "loader": loader, "in_epoch": in_epoch}

    def bundle(
        self,
        loop: Loop,
        *,
        in_epoch: dict[str, Any] | None = None,
        ranks: list[dict[str, Any]] | None = None,
        weights: tuple[dict, dict] | None = None,
    ) -> dict[str, Any]:
        """The checkpoint contents now; ``in_epoch`` is the loop's progress mid-epoch.

        ``ranks`` holds every rank's :meth:`rank_state` in a distributed run (rank 0's
        is also stored at the top level, as a single process stores it). ``weights``
        are the model's and optimizer's state dicts when gathered beforehand (FSDP).
        """
        ranks = ranks or [self.rank_state(in_epoch=in_epoch)]
        model_state, optimizer_state = weights or self.weights.state(self.model, self.optimizer)
        assert self.checkpointer is not None, "only the rank that writes checkpoints bundles"
        return {
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "train_state": self.state.state_dict(),
            "clipped_steps": self.clipper.clipped_steps.detach().cpu(),
            "checkpointer": self.checkpointer.state_dict(),
            "bad_records": self.bad_records.state_dict(),
            "history": loop.history,
            "numerics": loop.numerics.state_dict(),
            "callbacks": self.callbacks.state_dict(),
            "loader": ranks[0]["loader"],
            "in_epoch": in_epoch,
            "rng": ranks[0]["rng"],
            "ranks": ranks if len(ranks) > 1 else None,
            "world_size": len(ranks),
            "config": self.config,
            "data_fingerprint": self.fingerprint.to_dict() if self.fingerprint else None,
        }

    def restore(self, bundle: dict[str, Any], *, rank: int = 0) -> tuple[list[dict[str, Any]], Any]:
        """Load a bundle into the parts; returns (history, mid-epoch progress or None).

        Rank ``rank`` takes its own RNG states and loader position. The RNG states go
        last, so nothing built before consumes random numbers after.
        """
        ranks = bundle.get("ranks") or []
        own = ranks[rank] if rank < len(ranks) else bundle  # a world of 1 saved no "ranks"
        saved = bundle.get("config") or {}
        model_change = changed_keys(saved, self.config, "model")
        optim_change = changed_keys(saved, self.config, "optim")
        check_optimizer_class(self.optimizer, bundle["optimizer"], changed=optim_change)
        fresh = fresh_hyperparameters(self.optimizer)
        try:
            self.weights.load(self.model, self.optimizer, bundle["model"], bundle["optimizer"])
        except (RuntimeError, KeyError, ValueError) as exc:
            raise weights_error(exc, model_change=model_change, optim_change=optim_change) from None
        self.scheduler.load_state_dict(bundle["scheduler"])
        # A changed optim.lr / optim.weight_decay: set after the optimizer's old state.
        apply_hyperparameters(
            self.optimizer, self.scheduler, fresh, saved=saved, current=self.config
        )
        self.precision.load_state_dict(bundle["precision"])
        self.state.load_state_dict(bundle["train_state"])
        self.clipper.clipped_steps = bundle.get("clipped_steps", self.clipper.clipped_steps)
        if self.checkpointer is not None:
            self.checkpointer.load_state_dict(bundle["checkpointer"])
        self.bad_records.load_state_dict(bundle.get("bad_records", self.bad_records.state_dict()))
        self.train_loader.load_state_dict(own.get("loader", {"epoch": self.state.epoch}))
        for warning in self.callbacks.load_state_dict(bundle.get("callbacks")):
            logger.warning("resume: %s", warning)
        restore_rng_state(own["rng"])
        return list(bundle.get("history", [])), own.get("in_epoch", bundle.get("in_epoch"))


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[None]:
    """Turn SIGTERM/SIGINT/SIGHUP into a stop request the loop honours after the current step.

    The handler only sets a flag: saving inside a signal handler could interrupt a
    half-written step or checkpoint. A second stop signal of any kind stops at once
    (KeyboardInterrupt; a save it cuts short leaves the previous checkpoints as they
    were). Loader workers ignore these signals (``ignore_stop_signals``), so a signal to
    the whole process group stops the run as one to this process does. Outside the main
    thread (where handlers cannot be set) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request_stop(signum: int, frame: Any) -> None:
        if stop.requested:
            raise KeyboardInterrupt
        stop.signal_name = signal.Signals(signum).name

    previous = {sig: signal.signal(sig, request_stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def resume_mismatches(
    saved: dict[str, Any], current: dict[str, Any], *, steps_per_epoch: int | None = None
) -> list[str]:
    """``key: saved → now (why)`` for every config change a resume refuses.

    Which changes are refused, applied or adjusted is decided per key in
    :mod:`stoker.train.resume_changes`. ``train.epochs`` (and ``train.max_steps``) may
    change: ``--resume RUN_DIR train.epochs=N`` extends a run, and the extension is exact,
    bitwise what a run of N epochs from the start gives, when the lr schedule does not span
    the run's length. A cosine or one-cycle schedule without ``schedule.total_steps`` does:
    its horizon follows the run's length, so the epochs already trained followed another
    curve, and that is reported here too. ``steps_per_epoch`` is the optimizer steps in an
    epoch (None for data without a length).
    """
    changed = config_changes(saved, current).refused
    before = schedule_horizon(saved, steps_per_epoch=steps_per_epoch)
    now = schedule_horizon(current, steps_per_epoch=steps_per_epoch)
    if before is not None and now is not None and before != now:
        name = _lookup(current, ("schedule", "name"))
        warmup = int(_lookup(current, ("schedule", "warmup_steps")) or 0)
        after_warmup = f" after {warmup} warmup steps" if warmup else ""
        changed.append(
            f"the lr schedule's length: {name} decaying over {before} steps{after_warmup} in "
            f"the checkpoint, {now} now, as it spans the whole run (train.epochs, "
            "train.max_steps); an extension is "
            "exact with a fixed schedule.total_steps, and --allow-config-change continues "
            f"on the {now}-step curve from the step reached"
        )
    return changed


def schedule_horizon(config: dict[str, Any], *, steps_per_epoch: int | None) -> int | None:
    """The optimizer steps a decaying schedule spans when the run's length sets them.

    None when the schedule does not depend on the run's length: ``constant`` and
    ``step`` (warmup included), or a ``schedule.total_steps`` given. This mirrors the
    horizon ``stoker.train.optim.lr_multiplier`` gets from the session's total steps.
    """
    schedule = config.get("schedule") or {}
    if schedule.get("name") not in ("cosine", "onecycle") or schedule.get("total_steps"):
        return None
    train = config.get("train") or {}
    max_steps = train.get("max_steps")
    if steps_per_epoch is None:
        total = max_steps or 1
    else:
        total = steps_per_epoch * int(train.get("epochs") or 0)
        total = min(total, max_steps) if max_steps else total
    return max(1, total - int(schedule.get("warmup_steps") or 0))


def steps_per_epoch(loader: Any, *, grad_accum_steps: int) -> int | None:
    """Optimizer steps in one epoch of ``loader``; None for data without a length."""
    try:
        return math.ceil(len(loader) / grad_accum_steps)
    except TypeError:
        return None


def _lookup(config: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = config
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def check_resume_config(
    saved: dict[str, Any],
    config: RunConfig,
    *,
    allow: bool,
    saved_world: int = 1,
    world: int = 1,
    steps_per_epoch: int | None = None,
) -> None:
    """Refuses a resume whose settings changed what the next steps see (named, with the fix).

    Under ``allow`` (``--allow-config-change``) it warns that the run is no longer exact.
    """
    changed = resume_mismatches(saved, config.to_dict(), steps_per_epoch=steps_per_epoch)
    if saved_world != world:
        changed.append(f"world size (processes): {saved_world} in the checkpoint, {world} now")
    if not changed:
        return
    if allow:
        logger.warning(
            "resuming with changed settings (--allow-config-change), so the run is no longer "
            "exact: %s",
            "; ".join(changed),
        )
        return
    raise ConfigError(
        "the run being resumed was trained with other settings, so it could not continue "
        "exactly:\n" + "\n".join(f"  - {line}" for line in changed),
        hint="set them back, or pass --allow-config-change to resume anyway",
    )
