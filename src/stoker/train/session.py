"""One run from start to end: build the pieces from config, resume, loop, export."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from stoker import components
from stoker.checkpoint import (
    Checkpointer,
    export_safetensors,
)
from stoker.config import RunConfig, write_config
from stoker.data.fingerprint import fingerprint_dataset, verify_dataset, write_fingerprint
from stoker.data.prefetch import DevicePrefetcher
from stoker.data.records import BadRecordLog
from stoker.data.sources import length_or_none
from stoker.distributed.guards import (
    AgreedStop,
    RankSyncedLoader,
    Watchdog,
    check_same_data,
    explain_collective_failure,
)
from stoker.distributed.runtime import Distributed, distributed_run
from stoker.errors import TrainingInterrupted
from stoker.observe.progress import build_progress
from stoker.observe.report import write_report
from stoker.observe.sinks import NullSink, build_sinks
from stoker.observe.system import SystemMonitor, environment
from stoker.observe.timing import PhaseTimer
from stoker.observe.verdict import summary_lines
from stoker.safe_files import check_not_link, write_text
from stoker.train.callbacks import Callbacks
from stoker.train.grad_health import GradHealth
from stoker.train.grads import GradClipper
from stoker.train.loop import Loop, run
from stoker.train.model_errors import config_hints
from stoker.train.numerics import NumericsGuard, checkpoint_rollback
from stoker.train.optim import build_optimizer, build_scheduler
from stoker.train.pipeline import UserComponents, build_pipeline
from stoker.train.precision import build_precision
from stoker.train.resume import (
    ResumableParts,
    check_resume_config,
    steps_per_epoch,
    stop_on_signals,
)
from stoker.train.run_setup import (
    build_monitor,
    elastic_resume,
    prefetch_enabled,
    step_functions,
    total_steps,
)
from stoker.train.rundir import (
    RUN_FILES,
    load_resume_bundle,
    open_run_dir,
    per_rank,
    resume_command,
    say_where,
    write_summary,
)
from stoker.train.state import TrainState, seed_everything
from stoker.train.test_split import TestSplit
from stoker.train.threads import loader_workers, use_threads


@dataclass(frozen=True)
class FitResult:
    """What a run produced.

    Attributes:
        metrics: The last epoch's record (``train/loss``, ``val/accuracy``, ...).
        history: One record per epoch, oldest first (including epochs before a resume);
            each record's ``epoch`` counts from 1, as the progress lines do.
        run_dir: The folder the run wrote.
        model: The trained model (the plain module, not a compiled wrapper).
        best_value: The best value of the monitored metric, and ``best_epoch`` its epoch
            (from 1: the ``epoch`` of that record in ``history``).
        stopped_early: Whether early stopping ended the run before its last epoch
            (patience running out in the last epoch is no early stop).
        test_metrics: The test data's figures (``test/loss``, ...), evaluated once at
            the end (``data.test``, ``data.test_fraction``); empty without test data.
        stop_reason: Why a callback ended the run (``loop.request_stop``); None when
            it ran to its end.
    """

    metrics: dict[str, Any]
    history: list[dict[str, Any]]
    run_dir: Path
    model: nn.Module
    monitor: str
    best_value: float | None
    best_epoch: int | None
    stopped_early: bool
    test_metrics: dict[str, float] = field(default_factory=dict)
    stop_reason: str | None = None


def train_run(
    config: RunConfig,
    *,
    user: UserComponents = UserComponents(),
    resume: str | Path | None = None,
    progress: str = "auto",
    resume_hint: str | None = None,
    allow_data_change: bool = False,
    allow_config_change: bool = False,
) -> FitResult:
    """Train one run described by ``config``; ``user`` objects take the place of config names.

    Args:
        config: The validated run config.
        user: Components given as Python objects.
        resume: A run dir (or checkpoint file) to continue from.
        progress: ``auto``, ``rich``, ``plain`` or ``quiet``.
        resume_hint: The command that resumes this run, shown at the end.
        allow_data_change: Resume even if the training data's fingerprint changed.
        allow_config_change: Resume even if a setting the exact resume depends on changed.

    Under torchrun every rank calls this; rank 0 prints, tracks and writes checkpoints.
    """
    # A failing model's error points at the config key that sizes the failing layer.
    own = {"user_model": user.model is not None, "user_data": user.train_data is not None}
    hints = config_hints(config, **own)
    with hints, distributed_run(config.distributed, device_name=config.train.device) as dist:
        return _train_run(
            config,
            dist,
            user=user,
            resume=elastic_resume(config, dist, resume),
            progress=progress if dist.is_main else "quiet",
            resume_hint=resume_hint,
            allow_data_change=allow_data_change,
            allow_config_change=allow_config_change,
        )


def _train_run(
    config: RunConfig,
    dist: Distributed,
    *,
    user: UserComponents,
    resume: str | Path | None,
    progress: str,
    resume_hint: str | None,
    allow_data_change: bool,
    allow_config_change: bool,
) -> FitResult:
    seed_everything(config.seed)
    pipeline = build_pipeline(config, user)
    model, device = pipeline.model, pipeline.device
    loss_fn, train_loader, val_loader = pipeline.loss_fn, pipeline.train_loader, pipeline.val_loader

    model.to(device)
    # DDP or FSDP2 with several ranks; before the optimizer, as FSDP2 swaps the parameters.
    wrapped = dist.wrap(model, config.distributed, device=device)
    optimizer = build_optimizer(model, config.optim, device=device, user=user.optimizer)
    scheduler = build_scheduler(
        optimizer,
        config.schedule,
        total_steps=total_steps(config, train_loader),
        user=user.scheduler,
    )
    callbacks = Callbacks([*components.build_callbacks(config), *user.callbacks])
    step_fn, eval_fn = step_functions(config, user)
    precision = build_precision(config.train, device)
    state = TrainState()
    monitor = build_monitor(config, has_val=val_loader is not None, metrics=pipeline.metrics)
    test = TestSplit.from_pipeline(config, pipeline)

    # Rank 0 makes the run dir; the others write into the same one.
    run_dir = dist.broadcast(open_run_dir(config, resume) if dist.is_main else None)
    assert run_dir is not None  # every rank has rank 0's
    fingerprint = None
    if config.data.fingerprint != "off":
        fingerprint = fingerprint_dataset(
            pipeline.train_data, full=config.data.fingerprint == "full"
        )
    check_same_data(
        dist,
        length=length_or_none(pipeline.train_data),
        digest=fingerprint.digest if fingerprint is not None else None,
    )
    # Check that the run can be resumed before anything takes the checkpoint lock.
    bundle = load_resume_bundle(resume) if resume is not None else None
    data_warning = None
    if bundle is not None:
        if fingerprint is not None and bundle.get("data_fingerprint") is not None:
            data_warning = verify_dataset(
                pipeline.train_data, bundle["data_fingerprint"], allow_change=allow_data_change
            )
        check_resume_config(
            bundle.get("config", {}),
            config,
            allow=allow_config_change,
            saved_world=bundle.get("world_size", 1),
            world=dist.world_size,
            steps_per_epoch=steps_per_epoch(
                train_loader, grad_accum_steps=config.train.grad_accum_steps
            ),
        )
    checkpointer = None
    if dist.is_main:
        # Every file written here later, some only at the run's end: a planted link is
        # refused now, before the run trains (safe_files refuses it again when written).
        for name in (*RUN_FILES, per_rank("bad_records.jsonl", dist)):
            check_not_link(run_dir / name)
        checkpointer = Checkpointer(
            run_dir / "checkpoints",
            keep_last=config.checkpoint.keep_last,
            keep_best=config.checkpoint.keep_best,
            monitor=monitor.metric,
            mode=monitor.mode,
        )
    bad_records = BadRecordLog(
        run_dir / per_rank("bad_records.jsonl", dist),
        max_total=config.data.max_bad_records,
        max_consecutive=config.data.max_consecutive_bad_records,
    )
    train_loader.bad_records = bad_records
    if val_loader is not None:
        # One file and one count: a record is logged once, whichever split it is in.
        val_loader.bad_records = bad_records.for_split("val")
    parts = ResumableParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=precision,
        state=state,
        clipper=GradClipper(
            max_norm=config.train.clip_grad_norm, max_value=config.train.clip_grad_value
        ),
        checkpointer=checkpointer,
        bad_records=bad_records,
        train_loader=train_loader,
        config=config.to_dict(),
        fingerprint=fingerprint,
        weights=dist.weights_io(
            config.distributed,
            checkpoints=run_dir / "checkpoints",
            async_save=config.checkpoint.async_save,
        ),
        callbacks=callbacks,
    )
    history: list[dict[str, Any]] = []
    in_epoch = None
    if bundle is not None:
        history, in_epoch = parts.restore(bundle, rank=dist.rank)
    if dist.is_main:
        write_config(config, run_dir / "config.yaml")
        if fingerprint is not None:
            write_fingerprint(fingerprint, run_dir)

    # torch.compile of a Module is a Module (an OptimizedModule); its annotations say Callable.
    called_model = cast(nn.Module, torch.compile(wrapped)) if config.train.compile else wrapped
    tracking = config.tracking
    mlflow = None
    if tracking.mlflow:
        mlflow = {
            "tracking_uri": tracking.mlflow_uri,
            "experiment": tracking.mlflow_experiment,
            "run_name": run_dir.name,
            "params": config.to_dict(),
        }
    sink = (
        build_sinks(run_dir, tensorboard=tracking.tensorboard, mlflow=mlflow)
        if dist.is_main
        else NullSink()
    )
    view = build_progress(
        progress,  # type: ignore[arg-type]
        every_s=tracking.progress_every_s,
        every_steps=tracking.progress_every_steps,
        # The run's ETA counts the steps left: max_steps included, a resume's done left out.
        run_steps=total_steps(config, train_loader)
        if length_or_none(train_loader) is not None
        else config.train.max_steps,
        steps_done=state.step,
    )
    if dist.info.restart_count:
        view.message(f"restarted by torchrun (restart {dist.info.restart_count})")
    if bundle is not None:
        # state.epoch counts finished epochs: the last one's number, from 1.
        where = f"in epoch {state.epoch_number}" if in_epoch else f"after epoch {state.epoch}"
        view.message(f"resuming {run_dir} {where} (step {state.step})")
    elif resume is not None:
        view.message(f"{run_dir} has no checkpoint yet: starting it from the beginning")
    if data_warning:
        view.message(f"warning: {data_warning}")

    def save(
        loop: Loop, *, epoch: int, metrics: dict[str, Any] | None, in_epoch: dict[str, Any] | None
    ) -> None:
        settle_save(loop)  # the previous one, if still being written (async_save)
        # Every rank hands rank 0 its RNG states and loader position (a collective),
        # and under FSDP its shard of the weights.
        weights = parts.weights.state(model, optimizer)
        ranks = dist.gather(parts.rank_state(in_epoch=in_epoch))
        if checkpointer is not None:
            with watchdog.paused():
                path = checkpointer.save(
                    parts.bundle(loop, in_epoch=in_epoch, ranks=ranks, weights=weights),
                    epoch=epoch,
                    step=state.step,
                    metrics=metrics,
                    write_first=parts.weights.write_first(model, optimizer),
                )
            if not parts.weights.pending:
                callbacks.call("on_checkpoint", loop, path)
        else:
            parts.weights.join_write(model, optimizer)  # FSDP: each rank writes its shard

    def settle_save(loop: Loop) -> None:
        # FSDP with checkpoint.async_save: the save still being written becomes a
        # checkpoint (or an error on every rank) before the next save, a rollback, and
        # the end of the run, stopped or not. Training went on while it was written.
        if parts.weights.pending:
            with watchdog.paused():
                path = parts.weights.settle(checkpointer)
            if path is not None:
                callbacks.call("on_checkpoint", loop, path)

    def save_checkpoint(loop: Loop, record: dict[str, Any]) -> None:
        if config.checkpoint.enabled:
            save(loop, epoch=record["epoch"], metrics=record, in_epoch=None)

    def save_in_epoch(loop: Loop, progress: dict[str, Any]) -> None:
        # Not a candidate for best: there are no validation metrics mid-epoch.
        save(loop, epoch=state.epoch_number, metrics=None, in_epoch=progress)

    stop: Any = AgreedStop() if dist.enabled else None
    timer = PhaseTimer(device)
    watchdog = Watchdog(dist)
    loop_loader: Any = train_loader
    if dist.enabled:
        loop_loader = RankSyncedLoader(
            train_loader, dist, stop=stop, watchdog=watchdog, timer=timer
        )

    loop = Loop(
        model=called_model,
        optimizer=optimizer,
        scheduler=scheduler,
        precision=precision,
        clipper=parts.clipper,
        loss_fn=loss_fn,
        loss_name=config.loss.name,
        task="none" if step_fn is not None else components.task_of(config),
        train_loader=loop_loader,
        val_loader=val_loader,
        device=device,
        state=state,
        sink=sink,
        progress=view,
        monitor=monitor,
        on_epoch_end=save_checkpoint,
        timer=timer,
        system=SystemMonitor(device),
        health=GradHealth(config.train.grad_health_every, optimizer_kind=type(optimizer).__name__),
        prefetcher=DevicePrefetcher(
            device, enabled=prefetch_enabled(config.train.prefetch, device)
        ),
        epochs=config.train.epochs,
        max_steps=config.train.max_steps,
        grad_accum_steps=config.train.grad_accum_steps,
        log_every_steps=config.train.log_every_steps,
        normalize=config.loss.normalize,
        ignore_index=config.loss.ignore_index,
        history=history,
        metrics=pipeline.metrics,
        checkpoint_every_steps=config.checkpoint.every_steps,
        on_step_checkpoint=save_in_epoch if config.checkpoint.enabled else None,
        resume_in_epoch=in_epoch,
        numerics=NumericsGuard.from_config(config.train),
        rollback=checkpoint_rollback(
            run_dir / "checkpoints",
            lambda bundle: parts.restore(bundle, rank=dist.rank),
            before=lambda: settle_save(loop),
        )
        if config.checkpoint.enabled
        else None,
        callbacks=callbacks,
        step_fn=step_fn,
        eval_fn=eval_fn,
    )
    if stop is not None:
        loop.stop = stop
    if bundle is not None:
        loop.numerics.load_state_dict(bundle.get("numerics"))
    loop.no_sync = dist.no_sync(wrapped) or contextlib.nullcontext  # no DDP: nothing to hold
    loop.agree_finite = dist.agree_finite()
    threads = use_threads(config.train.threads, num_workers=loader_workers(train_loader))
    if dist.is_main:
        write_text(
            run_dir / "environment.json",
            json.dumps({**environment(), **threads.record()}, indent=2),
        )
    try:
        with stop_on_signals(loop.stop), explain_collective_failure(dist, "a training step"):
            try:
                run(loop)
            except TrainingInterrupted:
                settle_save(loop)  # the stop's checkpoint is complete before the run ends
                raise
            settle_save(loop)
        # Under FSDP the whole weights are gathered from every rank first (a collective).
        whole = parts.weights.export_state(model)
        if dist.is_main:
            export_safetensors(model, run_dir / "model.safetensors", state=whole)
        test_metrics = test.evaluate(loop, model=model, dist=dist, run_dir=run_dir)
    except TrainingInterrupted as stopped:
        stopped.hint = (
            f"resume with: {resume_command(resume_hint or '--resume {run_dir}', run_dir)}"
        )
        raise
    finally:
        threads.restore()
        watchdog.close()
        train_loader.close()  # persistent workers end with the run, not at a collection
        if val_loader is not None:
            val_loader.close()
        sink.close()
        if checkpointer is not None:
            checkpointer.close()
    if dist.is_main and loop.stop_reason is not None:
        saved = "; checkpoint saved" if config.checkpoint.enabled else "; no checkpoint"
        view.message(f"stopped by {loop.stop_reason} after step {state.step}{saved}")
    if dist.is_main:
        summary = write_summary(loop, run_dir)
        for line in summary_lines(summary):
            view.message(line)
        if skipped := summary.get("data", {}).get("bad_records"):
            view.message(f"skipped {skipped} bad record(s): {run_dir / 'bad_records.jsonl'}")
        test.report(view, run_dir)
        write_report(run_dir)
        say_where(view, run_dir, resume_hint)
    view.close()
    dist.barrier()  # rank 0's files are complete before any rank reports success
    return FitResult(
        metrics=loop.history[-1] if loop.history else {},
        history=loop.history,
        run_dir=run_dir,
        model=model,
        monitor=monitor.metric,
        best_value=state.best_value,
        best_epoch=state.best_epoch,
        stopped_early=loop.stopped_early,
        test_metrics=test_metrics,
        stop_reason=loop.stop_reason,
    )
