"""The training loop: one step reads top to bottom in the order data flows."""

from __future__ import annotations

import contextlib
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
from stoker.data.samplers import rank_and_world_size
from stoker.errors import TrainingInterrupted
from stoker.observe.system import SystemMonitor
from stoker.observe.timing import PhaseTimer, timing_record
from stoker.train.batch import batch_size_of
from stoker.train.callbacks import Callbacks
from stoker.train.grad_health import GradHealth
from stoker.train.grads import FiniteCheck, GradClipper, whole_tensor
from stoker.train.metric_set import NO_METRICS, Metrics
from stoker.train.metrics import StepWindow, Task, TaskMetrics
from stoker.train.monitor import Monitor, update_monitor
from stoker.train.numerics import (
    NumericsGuard,
    Restored,
    RollbackNeeded,
    RolledBack,
    check_step,
    overflow_step,
    roll_back,
)
from stoker.train.objective import LossStep, StepFn, UserStep, validate
from stoker.train.optim_calls import OptimizerCalls
from stoker.train.precision import Precision
from stoker.train.state import TrainState

_NO_CONTEXT = contextlib.nullcontext()  # stateless, so one serves every micro-batch


class EpochEndHook(Protocol):
    """Called after each epoch's record is written (checkpointing)."""

    def __call__(self, loop: Loop, record: dict[str, Any]) -> None:
        """Called after each epoch with its record."""


class StepCheckpointHook(Protocol):
    """Saves a checkpoint in the middle of an epoch (every N steps, or when stopping)."""

    def __call__(self, loop: Loop, progress: dict[str, Any]) -> None:
        """Save a checkpoint now; ``progress`` is the loader position an exact resume needs."""


class StopRequested(Exception):
    """A callback asked the run to stop after a step: ``run`` ends it (no error)."""


class StopRequest:
    """Set from a signal handler; read by the loop after each step (never acted on inside
    the handler, so a checkpoint is never written halfway through a step)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        """True once a stop signal arrived: the loop stops after the current step."""
        return self.signal_name is not None


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
    #: What a NaN/inf loss or gradient does (``train.on_nonfinite``), and its counts.
    numerics: NumericsGuard = field(default_factory=NumericsGuard)
    #: Restores the newest valid checkpoint, for ``on_nonfinite=rollback``; None when the
    #: run writes no checkpoints. See ``stoker.train.numerics.checkpoint_rollback``.
    rollback: Callable[[], Restored | None] | None = None
    #: A context in which backward does not all-reduce (DDP's ``model.no_sync``): with
    #: gradient accumulation, every micro-batch of a step but the last runs inside it.
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    #: Distributed: combines every rank's (loss finite, gradients finite) into one verdict.
    agree_finite: Callable[[bool, bool], tuple[bool, bool]] | None = None
    #: ``train.metrics``: computed on the validation (and test) data, not per step.
    metrics: Metrics = NO_METRICS
    #: ``optimizer.step()`` and ``zero_grad()`` as the loop makes them: through the scaler
    #: when scaling (fp16), else ``optimizer.step()`` (public calls only, see optim_calls).
    optimizer_calls: OptimizerCalls = field(init=False, repr=False)
    #: The user's callbacks (``stoker.train.callbacks``); none: each hook is a no-op.
    callbacks: Callbacks = field(default_factory=Callbacks)
    #: A user's ``step_fn(model, batch)`` in place of forward + loss, and the one
    #: validation uses (``eval_fn``, else ``step_fn``); None: the model and ``loss_fn``.
    step_fn: StepFn | None = None
    eval_fn: StepFn | None = None
    #: Why a callback asked the run to stop (``request_stop``); None while it trains on.
    stop_reason: str | None = None
    #: The last optimizer step's loss (a 0-d device tensor), for ``on_step_end``.
    step_loss: torch.Tensor | None = field(default=None, init=False, repr=False)
    #: Steps 3 and 4, forward and loss (``stoker.train.objective``).
    objective: LossStep | UserStep = field(init=False, repr=False)
    #: The last micro-batch's loss with its graph, kept until the next step's forward has
    #: run, as a hand loop's ``loss`` variable is. The graph's saved tensors are freed by
    #: backward already; what it keeps is its nodes, and through them the parameters'
    #: gradient accumulators, which the next forward then reuses instead of building four
    #: new ones per step (about 7,000 instructions, 0.7% of the seed MLP's step). Let go
    #: before that step's backward, so that backward can reuse the old graph's memory.
    #: Dropped at the end of each epoch.
    kept_graph: torch.Tensor | None = field(default=None, init=False, repr=False)
    _finite: FiniteCheck | None = field(default=None, init=False, repr=False)
    _params: list[nn.Parameter] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.optimizer_calls = OptimizerCalls(self.optimizer, self.precision)
        self.objective = UserStep(self.step_fn) if self.step_fn else LossStep(self)

    def log(self, metrics: dict[str, Any]) -> None:
        """Write ``metrics`` (``group/name`` keys) to the run's sinks at the current step."""
        state = self.state
        self.sink.log({"epoch": state.epoch_number, "step": state.step, **metrics})

    def request_stop(self, reason: str = "a callback") -> None:
        """End the run after the current step (or epoch), with a checkpoint to resume from.

        ``fit`` then returns normally; ``FitResult.stop_reason`` holds ``reason``.
        """
        self.stop_reason = reason
        if self.stop.signal_name is None:
            self.stop.signal_name = reason

    def to_device(self, batch: Any) -> Any:
        """Step 2, transfer: every tensor of ``batch`` to the training device.

        non_blocking overlaps the copy with compute when the batch is pinned. Training on
        the CPU the batch is already there: it is passed through without walking it, and
        the transfer phase is reported as 0 (the loop reads no clock for it).
        """
        if self.device.type == "cpu":
            return batch
        return move_to_device(batch, self.device, non_blocking=True)

    def finished(self) -> bool:
        """True when the epochs or ``max_steps`` are done."""
        return self.state.epoch >= self.epochs or self.out_of_steps()

    def out_of_steps(self) -> bool:
        """True when ``max_steps`` optimizer steps are done."""
        return self.max_steps is not None and self.state.step >= self.max_steps

    def parameters(self) -> list[nn.Parameter]:
        """The model's parameters, listed once (``model.parameters()`` walks every module)."""
        if self._params is None:
            self._params = list(self.model.parameters())
        return self._params

    def finite_check(self) -> FiniteCheck:
        """The non-finite check of the loss and gradients, built on the first step."""
        if self._finite is None:
            self._finite = FiniteCheck(self.parameters(), agree=self.agree_finite)
        return self._finite


_END = object()  # what next() returns once the epoch has no batch left


def train_step(loop: Loop, batches: Iterator[Any], metrics: TaskMetrics, window: StepWindow) -> int:
    """One optimizer step: fetch, transfer, forward, loss, backward, then ``_update``.

    Returns how many micro-batches it used: 0 when the epoch had none left. With
    ``grad_accum_steps`` > 1 the step is ``_train_accumulated``'s; this is the step of
    one micro-batch, with no lists of micro-batches, no weights and no ``no_sync`` (a
    lone backward always all-reduces). ``train_epoch`` calls it through the module each
    step, so a test (``tests/faults/resume_child.py``) can patch it.
    """
    if loop.grad_accum_steps != 1:
        return _train_accumulated(loop, batches, metrics, window)
    timer = loop.timer
    now = timer.now  # each phase's end is read into a local; the timer takes them at the end
    # 1. Fetch; the time blocked here is the data wait (its start ends the step before).
    fetching = now()
    batch = next(batches, _END)
    fetched = now()
    if batch is _END:
        timer.close_step(fetching)  # the step before ends where this fetch began
        return 0
    objective = loop.objective
    # Split into (inputs, targets) and counted on the host still: counting costs no sync.
    inputs, targets, size = objective.take(batch)
    # 2. Transfer: none on the CPU, where no clock is read for it either (it takes 0 s).
    transferred = fetched
    if timer.times_transfer:
        inputs, targets = loop.to_device((inputs, targets))
        transferred = now()
    precision = loop.precision
    # 3. Forward and 4. loss, in the run's precision (fp32: no context to enter).
    if precision.dtype is None:
        outputs, loss = objective(loop.model, inputs, targets)
    else:
        with precision.autocast():
            outputs, loss = objective(loop.model, inputs, targets)
    loop.kept_graph = loss  # the step before's graph is let go here, before backward
    forwarded = now()
    # 5. Backward: the batch's mean loss, unweighted.
    precision.backward(loss)
    # Held by the metrics and recorded: the values without the graph. ``.data`` is the
    # same tensor as ``detach()`` gives but made without a dispatch (a tenth of its cost);
    # its own version counter does not matter, as nothing writes to it.
    step_loss = loss.data
    metrics.update(outputs, targets, step_loss, size)
    loop.state.micro_step += 1
    timer.record((fetching, fetched, transferred, forwarded, now()))
    samples = size if loop.normalize == "samples" else batch_size_of(targets)
    _update(loop, step_loss, metrics, window, 1, samples)
    return 1


def _train_accumulated(
    loop: Loop, batches: Iterator[Any], metrics: TaskMetrics, window: StepWindow
) -> int:
    """``train_step`` over ``grad_accum_steps`` micro-batches, their losses weighted."""
    state, timer = loop.state, loop.timer
    now = timer.now
    # 1. Fetch this step's micro-batches; the time blocked here is the data wait.
    fetching = now()
    micro_batches = list(islice(batches, loop.grad_accum_steps))
    readings = [fetching, now()]
    if not micro_batches:
        timer.close_step(fetching)  # the step before ends where this fetch began
        return 0
    objective = loop.objective
    taken = [objective.take(batch) for batch in micro_batches]  # (inputs, targets, size)
    step_count = sum(size for _, _, size in taken)
    last = len(taken) - 1
    step_loss: torch.Tensor | None = None

    for index, (inputs, targets, size) in enumerate(taken):
        # 2. Transfer (non_blocking: overlaps with compute when the batch is pinned).
        inputs, targets = loop.to_device((inputs, targets))
        # On the CPU there is nothing to time: the transfer ends where it began.
        transferred = now() if timer.times_transfer else readings[-1]
        # Under DDP only the step's last backward all-reduces the gradients.
        with loop.no_sync() if index < last else _NO_CONTEXT:
            # 3. Forward and 4. loss, in the run's precision.
            with loop.precision.autocast():
                outputs, loss = objective(loop.model, inputs, targets)
            forwarded = now()
            # 5. Backward. Weighting by samples (or real tokens) makes the accumulated
            # gradient that of one batch of `step_count`, also for a smaller last
            # micro-batch or group. A lone micro-batch has weight 1: no multiply (the
            # gradient is bitwise the same).
            loop.precision.backward(loss if last == 0 else loss * (size / step_count))
        detached = loss.data  # as in train_step
        metrics.update(outputs, targets, detached, size)
        weighted = detached.float()
        if last:
            weighted = weighted * (size / step_count)
        step_loss = weighted if step_loss is None else step_loss + weighted
        state.micro_step += 1
        readings += (transferred, forwarded, now())
    timer.record(tuple(readings))
    loop.kept_graph = loss  # as in train_step
    assert step_loss is not None  # there was at least one micro-batch
    step_samples = (
        step_count  # already counted samples for the loss weights
        if loop.normalize == "samples"
        else sum(batch_size_of(targets) for _, targets, _ in taken)
    )
    _update(loop, step_loss, metrics, window, len(taken), step_samples)
    return len(taken)


def _update(
    loop: Loop,
    step_loss: torch.Tensor,
    metrics: TaskMetrics,
    window: StepWindow,
    batches: int,
    samples: int,
    checked: tuple[bool, bool] | None = None,
) -> None:
    """Steps 6 to 9 of any step (one micro-batch or accumulated): check, update, record.

    ``checked``: the non-finite check's verdict when the step made it already (the
    plain step's, see ``plain_step``), so it is not made twice.
    """
    state, precision, optimizer = loop.state, loop.precision, loop.optimizer
    calls = loop.optimizer_calls
    scaling = precision.name == "fp16"  # loss scaling: what `precision.scaling` reports
    # 6. Unscale (fp16), then check the loss and every gradient for inf/NaN before clipping
    # or the optimizer touch anything: the step's one CPU–GPU sync point.
    if scaling:
        precision.unscale_(optimizer)
    verdict = check_step(loop, step_loss, metrics, batches=batches, checked=checked)
    norm = None
    sampled = False
    if verdict == "ok":
        # 7. Measure the norm (when recorded or needed), clip, step the optimizer.
        health = loop.health
        if health.every_n_steps and health.should_sample(state.step):
            sampled = True
            health.before_step(loop.model, state.step)  # per-layer norms on sampled steps
        if not window.norms or loop.clipper.clipping:
            norm = _clip(loop, wanted=not window.norms)
        calls.step()  # precision.step(optimizer) when scaling (fp16)
        if scaling:
            loop.numerics.stepped()  # an fp16 overflow streak, if any, is over
    elif verdict == "overflow":
        overflow_step(loop)  # fp16: the scaler skips the step and lowers its scale
    else:
        precision.skip_step(optimizer)  # on_nonfinite=skip: nothing is updated
    calls.zero_grad()  # optimizer.zero_grad(set_to_none=True)
    # 8. Schedule: the lr moves once per step, a skipped one too (as with fp16 overflow).
    loop.scheduler.step()
    # The optimizer phase runs on to the next fetch: it holds the record below too.
    if sampled:
        loop.timer.close_step()  # the update ratios below are measuring, not training
        if health_record := loop.health.after_step(loop.model):
            loop.sink.log({"epoch": state.epoch_number, "step": state.step + 1, **health_record})

    # 9. Record; the loss as the check read it, the norm on the device.
    loop.step_loss = step_loss
    state.step += 1
    state.samples_seen += samples
    if verdict != "skipped":
        window.loss_sum += loop._finite.loss_value  # type: ignore[union-attr]
        window.losses += 1
    if norm is not None:
        window.grad_norm += norm if isinstance(norm, float) else norm.float().to(loop.device)
        window.norms += 1
    window.steps += 1
    window.samples += samples


#: The check's verdict on a step whose loss and gradients are all finite.
_FINITE = (True, True)


def plain_step(
    loop: Loop, metrics: TaskMetrics
) -> Callable[[Iterator[Any], StepWindow], int] | None:
    """``train_step`` for the common run, with all it reads bound once per epoch.

    On a small model every attribute read and call of the loop's own shows in the step
    time (the seed MLP's step is under 200 µs; ``docs/performance.md`` says what each
    part of the bookkeeping costs there). The common run — one micro-batch a step, fp32,
    no clipping, the built-in forward and loss over samples — steps here from locals.
    The metrics hold the loss as the number the check read, not as a tensor: a tensor
    kept per step until the metrics fold (256 steps on the CPU) leaves the allocator
    fewer freed blocks to reuse (on the seed MLP about 3,700 instructions of malloc's a
    step, counted by callgrind).
    A step that needs more goes on from the check's verdict through ``_update``: a
    non-finite loss or gradient, every step of ``on_nonfinite=skip`` (which keeps the
    metrics first), a step whose gradients the health check samples, and each window's
    first (its gradient norm is recorded).

    Returns ``step(batches, window)``, which makes one step and returns how many
    micro-batches it used (0 when the epoch had none left), as ``train_step`` does; or
    None when the run is not the common one, and ``train_step`` serves every step.
    """
    if (
        loop.grad_accum_steps != 1
        or loop.precision.dtype is not None
        or loop.clipper.clipping
        or loop.normalize != "samples"
        or loop.step_fn is not None  # its metrics take the loss as a tensor
    ):
        return None
    state, model, objective, timer = loop.state, loop.model, loop.objective, loop.timer
    now, record, close_step, take = timer.now, timer.record, timer.close_step, objective.take
    transfer, to_device, add_metrics = timer.times_transfer, loop.to_device, metrics.update
    check, calls, schedule = loop.finite_check(), loop.optimizer_calls, loop.scheduler.step
    optimizer_step, zero_grad = calls.step, calls.zero_grad
    keeping = loop.numerics.policy == "skip"  # keeps the metrics before every update
    sampled_every = loop.health.every_n_steps  # 0: never sampled

    def step(batches: Iterator[Any], window: StepWindow) -> int:
        # The same steps as train_step's, numbered as there.
        fetching = now()  # 1. fetch
        batch = next(batches, _END)
        fetched = transferred = now()
        if batch is _END:
            close_step(fetching)
            return 0
        inputs, targets, size = take(batch)
        if transfer:  # 2. transfer
            inputs, targets = to_device((inputs, targets))
            transferred = now()
        outputs, loss = objective(model, inputs, targets)  # 3. forward and 4. loss
        loop.kept_graph = loss  # as in train_step
        forwarded = now()
        loss.backward()  # 5. backward
        step_loss = loss.data
        record((fetching, fetched, transferred, forwarded, now()))
        verdict = check(step_loss)  # 6. check
        add_metrics(outputs, targets, check.loss_value, size)  # the number the check read
        state.micro_step += 1
        if (
            verdict != _FINITE
            or keeping
            or not window.norms
            or (sampled_every and state.step % sampled_every == 0)
        ):
            _update(loop, step_loss, metrics, window, 1, size, checked=verdict)
            return 1
        optimizer_step()  # 7. update
        zero_grad()
        schedule()  # 8. schedule
        loop.step_loss = step_loss  # 9. record
        state.step += 1
        state.samples_seen += size
        window.loss_sum += check.loss_value
        window.losses += 1
        window.steps += 1
        window.samples += size
        return 1

    return step


def _clip(loop: Loop, *, wanted: bool) -> torch.Tensor | float | None:
    """Clip (when configured); returns the pre-clip norm when ``wanted`` or clipping by norm.

    Not clipping, the norm is only recorded: when the step's non-finite check measured
    it on the way (``FiniteCheck.grad_norm``), that host number is returned instead of
    a second pass over every gradient (``get_total_norm``: on the seed MLP about
    170,000 instructions, a sixth of a step). Clipping by norm measures as
    ``clip_grad_norm_`` does, so that the clipped gradients are bitwise its.
    """
    clipper = loop.clipper
    if not clipper.clipping:
        if not wanted:
            return None
        measured = loop.finite_check().grad_norm
        if measured is not None:
            return measured
    params = loop.parameters()
    norm = clipper.measure([p.grad for p in params if p.grad is not None], wanted=wanted)
    if clipper.clipping:
        clipper.apply_(params, norm)
        loop.health.observe_clip(clipper.last_clipped)
    # Under FSDP the norm is a DTensor over every rank's shard: the recorded figure is whole.
    return whole_tensor(norm) if norm is not None else None


def train_epoch(loop: Loop) -> dict[str, Any]:
    """Train one epoch (or up to ``max_steps``); returns the epoch's train metrics.

    Raises:
        RolledBack: A fault rolled the run back to a checkpoint; ``run`` goes on from it.
    """
    state = loop.state
    loop.train_loader.set_epoch(state.epoch)
    loop.model.train()
    metrics = TaskMetrics(loop.task, ignore_index=_ignored(loop), loss_fn=loop.loss_fn)
    metrics = loop.objective.metrics(metrics)  # a step_fn's other outputs are summed too
    window = StepWindow.empty(loop.device)
    epoch_norm_sum = torch.zeros((), device=loop.device)
    epoch_norms = 0
    loop.timer.reset()
    steps = consumed = 0
    samples_before = state.samples_seen
    if loop.resume_in_epoch is not None:
        # The loader already skips the batches trained on before the restart.
        resumed, loop.resume_in_epoch = loop.resume_in_epoch, None
        metrics.load_state_dict(resumed["metrics"])
        epoch_norm_sum += resumed["grad_norm_sum"].to(loop.device)
        steps, consumed = resumed["steps"], resumed["batches"]
        epoch_norms = resumed.get("grad_norm_count", steps)  # older checkpoints: every step
    if loop.numerics.policy == "skip":
        loop.numerics.keep(metrics)
    started = time.perf_counter()
    loop.progress.start_epoch(
        state.epoch_number, epochs=loop.epochs, total_steps=_steps_per_epoch(loop)
    )
    # On CUDA the next batch is copied on a side stream while this one computes.
    batches = iter(loop.prefetcher.wrap(loop.train_loader))
    # Read once for the epoch: what every step checks (each lookup costs on a tiny step).
    max_steps, stop, log_every = loop.max_steps, loop.stop, loop.log_every_steps
    checkpointing, advance = loop.on_step_checkpoint is not None, loop.progress.advance
    step_end = loop.callbacks.step_end  # the callbacks' on_step_end; a no-op when none
    plain = plain_step(loop, metrics)  # None: train_step makes every step
    while max_steps is None or state.step < max_steps:
        try:
            used = plain(batches, window) if plain else train_step(loop, batches, metrics, window)
        except RollbackNeeded as needed:
            roll_back(loop, needed.fault, batches=consumed + needed.batches)
            raise RolledBack(str(needed.fault)) from None
        if not used:
            break
        steps += 1
        consumed += used
        step_end(loop, metrics, consumed)
        if checkpointing and _should_checkpoint(loop):
            loop.timer.close_step()  # a save is no step's time
            loop.on_step_checkpoint(  # type: ignore[misc]
                loop,
                {
                    "batches": consumed,
                    "steps": steps,
                    "metrics": metrics.state_dict(),
                    "grad_norm_sum": (epoch_norm_sum + window.grad_norm).detach().cpu(),
                    "grad_norm_count": epoch_norms + window.norms,
                },
            )
        if stop.requested:  # AgreedStop (distributed) has its own `requested`
            if loop.stop_reason is not None:
                raise StopRequested  # a callback's request: the run ends without an error
            raise TrainingInterrupted(
                f"stopped by {stop.signal_name} after step {state.step} "
                f"(epoch {state.epoch_number}, batch {consumed})"
                + ("; checkpoint saved" if loop.on_step_checkpoint else "; no checkpoint"),
                hint="resume with --resume RUN_DIR (the run dir printed above)",
            )
        if window.steps >= log_every:
            loop.timer.close_step()  # nor is the record (a sync point on a GPU)
            epoch_norm_sum += window.grad_norm
            epoch_norms += window.norms
            _record_window(loop, window)
            window = StepWindow.empty(loop.device)
        else:
            advance(1)
    loop.timer.close_step()  # the last step, when max_steps (not the data) ended the epoch
    loop.kept_graph = None  # validation and the epoch's end need none of it
    epoch_norm_sum += window.grad_norm
    epoch_norms += window.norms
    epoch_s = time.perf_counter() - started
    record = metrics.compute("train")
    record["lr"] = loop.scheduler.get_last_lr()[0]
    if epoch_norms:
        # The mean of the norms measured (see StepWindow), not of every step's.
        record["grad/norm"] = epoch_norm_sum.item() / epoch_norms
    record["time/epoch_s"] = epoch_s
    per_s = 1 / epoch_s if epoch_s > 0 else 0.0
    if loop.normalize == "tokens":
        # The metrics count real tokens (what the loss averages over); samples the state.
        record["throughput/tokens_per_s"] = metrics.samples * per_s
        record["throughput/samples_per_s"] = (state.samples_seen - samples_before) * per_s
    else:
        record["throughput/samples_per_s"] = metrics.samples * per_s
    record.update(timing_record(loop.timer.summary()))
    record.update(loop.system.sample(num_workers=_num_workers(loop.train_loader)))
    record.update(loop.numerics.epoch_record(loss_scale=loop.precision.loss_scale()))
    if loop.clipper.clipping:
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
    """A step-level record: mean loss and grad norm since the last one (a sync point).

    Distributed, the loss is averaged over the ranks and the throughput is all ranks'
    (every rank trains the same number of samples per step).
    """
    world = rank_and_world_size()[1]
    elapsed = time.perf_counter() - window.started
    samples_per_s = window.samples * world / elapsed if elapsed > 0 else 0.0
    record: dict[str, Any] = {"epoch": loop.state.epoch_number, "step": loop.state.step}
    loss = None
    if window.losses:
        loss_sum = window.loss_sum
        if world > 1:  # every rank records on the same steps
            summed = torch.tensor(loss_sum, dtype=torch.float64, device=loop.device)
            torch.distributed.all_reduce(summed)
            loss_sum = summed.item()
        loss = loss_sum / (window.losses * world)
        record["train/loss"] = loss
    record["lr"] = loop.scheduler.get_last_lr()[0]
    if window.norms:
        record["grad/norm"] = window.grad_norm.item() / window.norms
    record["throughput/samples_per_s"] = samples_per_s
    loop.sink.log(record)
    loop.progress.advance(1, loss=loss, samples_per_s=samples_per_s)


def run(loop: Loop) -> list[dict[str, Any]]:
    """Train until the epochs or steps run out, early stopping fires or a callback asks to
    stop; returns the history."""
    state, callbacks = loop.state, loop.callbacks
    callbacks.call("on_train_start", loop)
    while not loop.finished() and not loop.stopped_early and loop.stop_reason is None:
        # Records, messages and progress all number epochs from 1 (TrainState.epoch_number).
        record: dict[str, Any] = {"epoch": state.epoch_number}
        try:
            record.update(train_epoch(loop))
        except RolledBack:
            continue  # restored from a checkpoint: train on from there
        except StopRequested:
            break  # mid-epoch: the step's checkpoint resumes the epoch where it stopped
        if loop.val_loader is not None:
            validation = validate(loop)
            callbacks.call("on_validation_end", loop, validation)
            record.update(validation)
        bad_records = getattr(loop.train_loader, "bad_records", None)
        if bad_records is not None and bad_records.total:  # data.bad_records=skip met some
            record["data/bad_records"] = bad_records.total  # distinct, train and val
        record["step"] = state.step
        update_monitor(loop, record)
        callbacks.call("on_epoch_end", loop, record)  # what it adds to record is logged
        loop.sink.log(record)
        loop.progress.end_epoch(record["epoch"], record)
        loop.history.append(record)
        state.epoch += 1
        loop.on_epoch_end(loop, record)
    callbacks.call("on_train_end", loop)
    return loop.history
