"""The training loop: one step reads top to bottom in the order data flows."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Literal, Protocol

import torch
from torch import nn

from stoker.data.device import move_to_device
from stoker.data.prefetch import DevicePrefetcher
from stoker.errors import TrainingError, TrainingInterrupted
from stoker.observe.system import SystemMonitor
from stoker.observe.timing import PhaseTimer, timing_record
from stoker.train.batch import batch_size_of, explain_loss_failure, forward, split_batch
from stoker.train.evaluate import evaluate
from stoker.train.grad_health import GradHealth
from stoker.train.grads import GradClipper, first_nonfinite_grad
from stoker.train.metrics import Task, TaskMetrics
from stoker.train.precision import Precision
from stoker.train.state import TrainState


class EpochEndHook(Protocol):
    """Called after each epoch's record is written (checkpointing)."""

    def __call__(self, loop: Loop, record: dict[str, Any]) -> None: ...


class StepCheckpointHook(Protocol):
    """Saves a checkpoint in the middle of an epoch (every N steps, or when stopping)."""

    def __call__(self, loop: Loop, progress: dict[str, Any]) -> None: ...


class StopRequest:
    """Set from a signal handler; read by the loop after each step (never acted on inside
    the handler, so a checkpoint is never written halfway through a step)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None


@dataclass
class Monitor:
    """The metric that picks the best epoch and drives early stopping."""

    metric: str
    mode: Literal["min", "max"]
    patience: int | None = None
    min_delta: float = 0.0

    def improved(self, value: float, best: float | None) -> bool:
        if math.isnan(value):
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta


@dataclass
class Loop:
    """Everything the loop touches, built from config by ``stoker.train.session``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    clipper: GradClipper
    loss_fn: Callable[[Any, Any], torch.Tensor]
    loss_name: str
    task: Task | None
    train_loader: Any
    val_loader: Any | None
    device: torch.device
    state: TrainState
    sink: Any
    progress: Any
    monitor: Monitor
    on_epoch_end: EpochEndHook
    timer: PhaseTimer
    system: SystemMonitor
    health: GradHealth
    prefetcher: DevicePrefetcher
    epochs: int
    max_steps: int | None = None
    grad_accum_steps: int = 1
    log_every_steps: int = 50
    normalize: Literal["samples", "tokens"] = "samples"
    ignore_index: int = -100
    history: list[dict[str, Any]] = field(default_factory=list)
    stopped_early: bool = False
    checkpoint_every_steps: int | None = None
    on_step_checkpoint: StepCheckpointHook | None = None
    stop: StopRequest = field(default_factory=StopRequest)
    #: Set on a resume in the middle of an epoch: the epoch's progress so far.
    resume_in_epoch: dict[str, Any] | None = None
    warned: set[str] = field(default_factory=set)

    def finished(self) -> bool:
        return self.state.epoch >= self.epochs or self.out_of_steps()

    def out_of_steps(self) -> bool:
        return self.max_steps is not None and self.state.step >= self.max_steps


@dataclass
class StepWindow:
    """Sums since the last step-level record, kept on the device (no per-step sync)."""

    loss: torch.Tensor
    grad_norm: torch.Tensor
    steps: int = 0
    samples: int = 0
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def empty(cls, device: torch.device) -> StepWindow:
        return cls(torch.zeros((), device=device), torch.zeros((), device=device))


def train_step(loop: Loop, batches: Iterator[Any], metrics: TaskMetrics, window: StepWindow) -> int:
    """One optimizer step over ``grad_accum_steps`` micro-batches.

    Returns how many micro-batches it used: 0 when the epoch had none left.
    """
    state, timer = loop.state, loop.timer
    # 1. Fetch this step's micro-batches; the time blocked here is the data wait.
    timer.start_step()
    micro_batches = list(islice(batches, loop.grad_accum_steps))
    timer.data_ready()
    if not micro_batches:
        return 0
    sizes = [_count(loop, split_batch(batch)[1]) for batch in micro_batches]
    step_count = sum(sizes)
    single = len(micro_batches) == 1
    step_loss: torch.Tensor | None = None

    for batch, size in zip(micro_batches, sizes, strict=True):
        # 2. Transfer (non_blocking: overlaps with compute when the batch is pinned).
        inputs, targets = split_batch(move_to_device(batch, loop.device, non_blocking=True))
        timer.lap("transfer")
        # 3. Forward and 4. loss, in the run's precision.
        with loop.precision.autocast():
            outputs = forward(loop.model, inputs)
            loss = _loss(loop, outputs, targets)
        timer.lap("forward")
        # 5. Backward. Weighting by samples (or real tokens) makes the accumulated gradient
        # that of one batch of `step_count`, also for a smaller last micro-batch or group.
        # A lone micro-batch has weight 1: skip the multiply (the gradient is bitwise the same).
        loop.precision.backward(loss if single else loss * (size / step_count))
        metrics.update(outputs, targets, loss, size)
        weighted = loss.detach().float() if single else loss.detach().float() * (size / step_count)
        step_loss = weighted if step_loss is None else step_loss + weighted
        state.micro_step += 1
        timer.lap("backward")

    # 6. Unscale (fp16) so the norm is the true one, measure it, clip.
    loop.precision.unscale_(loop.optimizer)
    loop.health.before_step(loop.model, state.step)  # per-layer norms on sampled steps
    grad_norm = loop.clipper.clip_(loop.model.parameters())
    loop.health.observe_clip(loop.clipper.last_clipped)
    assert step_loss is not None  # there was at least one micro-batch
    _halt_on_nonfinite(loop, step_loss, grad_norm)  # CPU–GPU sync point, once per step.

    # 7. Optimizer step (the scaler skips it if an fp16 gradient overflowed), clear grads.
    loop.precision.step(loop.optimizer)
    loop.optimizer.zero_grad(set_to_none=True)
    # 8. Schedule: the lr moves once per optimizer step.
    loop.scheduler.step()
    timer.lap("optimizer")
    timer.end_step()
    if health := loop.health.after_step(loop.model):  # a sync, on sampled steps only
        loop.sink.log({"epoch": state.epoch, "step": state.step + 1, **health})

    # 9. Record, on the device; read only every `log_every_steps`.
    state.step += 1
    step_samples = (
        step_count  # already counted samples for the loss weights
        if loop.normalize == "samples"
        else sum(batch_size_of(split_batch(batch)[1]) for batch in micro_batches)
    )
    state.samples_seen += step_samples
    window.loss += step_loss
    window.grad_norm += grad_norm.detach().float().to(loop.device)
    window.steps += 1
    window.samples += step_samples
    return len(micro_batches)


def _count(loop: Loop, targets: Any) -> int:
    """What a micro-batch's loss is averaged over: its samples, or its real tokens."""
    if loop.normalize == "tokens":
        # Targets are still on the host here, so counting costs no device sync.
        return int((targets != loop.ignore_index).sum())
    return batch_size_of(targets)


def _loss(loop: Loop, outputs: Any, targets: Any) -> torch.Tensor:
    try:
        return loop.loss_fn(outputs, targets)
    except (RuntimeError, ValueError, IndexError) as error:
        raise explain_loss_failure(error, outputs, targets, loss_name=loop.loss_name) from error


def _halt_on_nonfinite(loop: Loop, step_loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
    loss_ok, norm_ok = torch.isfinite(torch.stack([step_loss, grad_norm.float()])).tolist()
    if loss_ok and (norm_ok or loop.precision.scaling):
        # With fp16 loss scaling an overflowing gradient is expected now and then:
        # the scaler skips that step and lowers the scale.
        return
    where = first_nonfinite_grad(loop.model)
    step = loop.state.step + 1
    what = "loss" if not loss_ok else "gradient"
    raise TrainingError(
        f"non-finite {what} at step {step} (epoch {loop.state.epoch}): loss={step_loss.item()}, "
        f"grad norm={grad_norm.item()}; first parameter with a non-finite gradient: "
        f"{where or 'none (the loss itself is not finite)'}",
        hint="lower optim.lr, set train.clip_grad_norm, or check the data for NaN/inf values",
    )


def train_epoch(loop: Loop) -> dict[str, Any]:
    """Train one epoch (or up to ``max_steps``); returns the epoch's train metrics."""
    state = loop.state
    loop.train_loader.set_epoch(state.epoch)
    loop.model.train()
    metrics = TaskMetrics(loop.task, ignore_index=_ignored(loop))
    window = StepWindow.empty(loop.device)
    epoch_norm_sum = torch.zeros((), device=loop.device)
    loop.timer.reset()
    steps = consumed = 0
    if loop.resume_in_epoch is not None:
        # The loader already skips the batches trained on before the restart.
        resumed, loop.resume_in_epoch = loop.resume_in_epoch, None
        metrics.load_state_dict(resumed["metrics"])
        epoch_norm_sum += resumed["grad_norm_sum"].to(loop.device)
        steps, consumed = resumed["steps"], resumed["batches"]
    started = time.perf_counter()
    loop.progress.start_epoch(
        state.epoch + 1, epochs=loop.epochs, total_steps=_steps_per_epoch(loop)
    )
    # On CUDA the next batch is copied on a side stream while this one computes.
    batches = iter(loop.prefetcher.wrap(loop.train_loader))
    while not loop.out_of_steps():
        used = train_step(loop, batches, metrics, window)
        if not used:
            break
        steps += 1
        consumed += used
        if _should_checkpoint(loop):
            loop.on_step_checkpoint(  # type: ignore[misc]
                loop,
                {
                    "batches": consumed,
                    "steps": steps,
                    "metrics": metrics.state_dict(),
                    "grad_norm_sum": (epoch_norm_sum + window.grad_norm).detach().cpu(),
                },
            )
        if loop.stop.requested:
            raise TrainingInterrupted(
                f"stopped by {loop.stop.signal_name} after step {state.step} "
                f"(epoch {state.epoch + 1}, batch {consumed})"
                + ("; checkpoint saved" if loop.on_step_checkpoint else "; no checkpoint"),
                hint="resume with --resume RUN_DIR (the run dir printed above)",
            )
        if window.steps >= loop.log_every_steps:
            epoch_norm_sum += window.grad_norm
            _record_window(loop, window)
            window = StepWindow.empty(loop.device)
        else:
            loop.progress.advance(1)
    epoch_norm_sum += window.grad_norm
    epoch_s = time.perf_counter() - started
    record = metrics.compute("train")
    record.update(
        {
            "lr": loop.scheduler.get_last_lr()[0],
            "grad/norm": epoch_norm_sum.item() / max(steps, 1),
            "time/epoch_s": epoch_s,
            "throughput/samples_per_s": metrics.samples / epoch_s if epoch_s > 0 else 0.0,
        }
    )
    record.update(timing_record(loop.timer.summary()))
    record.update(loop.system.sample(num_workers=_num_workers(loop.train_loader)))
    if loop.clipper.max_norm is not None or loop.clipper.max_value is not None:
        record["grad/clip_rate"] = loop.clipper.clipped_steps.item() / max(state.step, 1)
    for warning in loop.health.warnings():
        kind = warning[:24]  # the same advice with other figures is not news
        if kind not in loop.warned:
            loop.warned.add(kind)
            loop.progress.message(f"warning: {warning}")
    return record


def _ignored(loop: Loop) -> int | None:
    return loop.ignore_index if loop.normalize == "tokens" else None


def _should_checkpoint(loop: Loop) -> bool:
    if loop.on_step_checkpoint is None:
        return False
    every = loop.checkpoint_every_steps
    return loop.stop.requested or bool(every and loop.state.step % every == 0)


def _num_workers(loader: Any) -> int:
    return getattr(getattr(loader, "dataloader", None), "num_workers", 0)


def _steps_per_epoch(loop: Loop) -> int | None:
    try:
        return math.ceil(len(loop.train_loader) / loop.grad_accum_steps)
    except TypeError:
        return None


def _record_window(loop: Loop, window: StepWindow) -> None:
    """A step-level record: mean loss and grad norm since the last one (a sync point)."""
    loss = window.loss.item() / window.steps
    elapsed = time.perf_counter() - window.started
    samples_per_s = window.samples / elapsed if elapsed > 0 else 0.0
    loop.sink.log(
        {
            "epoch": loop.state.epoch,
            "step": loop.state.step,
            "train/loss": loss,
            "lr": loop.scheduler.get_last_lr()[0],
            "grad/norm": window.grad_norm.item() / window.steps,
            "throughput/samples_per_s": samples_per_s,
        }
    )
    loop.progress.advance(1, loss=loss, samples_per_s=samples_per_s)


def run(loop: Loop) -> list[dict[str, Any]]:
    """Train until the epochs or steps run out or early stopping fires; returns the history."""
    state = loop.state
    while not loop.finished() and not loop.stopped_early:
        record: dict[str, Any] = {"epoch": state.epoch}
        record.update(train_epoch(loop))
        if loop.val_loader is not None:
            record.update(
                evaluate(
                    loop.model,
                    loop.val_loader,
                    loop.loss_fn,
                    device=loop.device,
                    precision=loop.precision,
                    task=loop.task,
                    ignore_index=_ignored(loop),
                )
            )
        record["step"] = state.step
        _update_monitor(loop, record)
        loop.sink.log(record)
        loop.progress.end_epoch(state.epoch + 1, record)
        loop.history.append(record)
        state.epoch += 1
        loop.on_epoch_end(loop, record)
    return loop.history


def _update_monitor(loop: Loop, record: dict[str, Any]) -> None:
    state, monitor = loop.state, loop.monitor
    if monitor.metric not in record:
        raise TrainingError(
            f"train.monitor: metric {monitor.metric!r} was not produced; "
            f"this run records {', '.join(sorted(k for k in record if '/' in k))}",
            hint="set train.monitor to one of those",
        )
    value = float(record[monitor.metric])
    if monitor.improved(value, state.best_value):
        state.best_value, state.best_epoch = value, state.epoch
        state.epochs_without_improvement = 0
    else:
        state.epochs_without_improvement += 1
    if monitor.patience is not None and state.epochs_without_improvement >= monitor.patience:
        loop.stopped_early = True
        loop.progress.message(
            f"early stopping: {monitor.metric} has not improved for {monitor.patience} "
            f"epochs (best {state.best_value:.4f} at epoch {state.best_epoch})"
        )
