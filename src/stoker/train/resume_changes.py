"""What a resume does with each config change: apply it, apply it with a message, or refuse it.

Every key of the run config has one decision here (a test checks that none is missing),
and docs/checkpoints.md shows the same table:

- ``applied``: the change keeps the run exact, or touches only what is logged, kept or
  reported (epochs, logging, tracking, checkpoint rotation, fault policies).
- ``adjusted``: ``optim.lr`` and ``optim.weight_decay``. The checkpoint's optimizer state
  holds the old values; the new ones are set into its param groups (and the lr schedule's
  base) after loading, with a message. The run is no longer what the old settings give,
  which is the point of changing them.
- ``refused``: the change alters what the next steps see or compute (sampler, weights,
  shuffle buffer, batch size, model, optimizer, schedule, precision...). The key is named;
  ``--allow-config-change`` continues anyway, with a warning that the run is not exact.
  A model or optimizer that cannot take the checkpoint's state is refused even then.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from stoker.errors import CheckpointError

logger = logging.getLogger("stoker")

Decision = Literal["applied", "adjusted", "refused"]

_SAMPLES = "changes which samples each step sees"
_MODEL = "changes the model being trained"
_UPDATE = "changes how each step updates the weights"

#: Decision and reason per config key; a key not listed takes its section's entry.
POLICY: dict[tuple[str, ...], tuple[Decision, str]] = {
    ("name",): ("applied", "a label"),
    ("seed",): ("refused", "seeds shuffling, dropout and workers"),
    ("model",): ("refused", _MODEL),
    ("data", "train"): ("refused", f"{_SAMPLES} (its source, files, shuffle buffer)"),
    ("data", "val"): ("applied", "validation only"),
    ("data", "val_fraction"): ("refused", "changes the train/val split"),
    ("data", "split_seed"): ("refused", "changes the train/val split"),
    ("data", "test"): ("applied", "evaluated once at the end"),
    ("data", "test_fraction"): ("refused", "changes the train/test split"),
    ("data", "test_checkpoint"): ("applied", "which weights the test split sees"),
    ("data", "fingerprint"): ("applied", "a check"),
    ("data", "cache"): ("applied", "the same samples, read another way"),
    ("data", "cache_path"): ("applied", "the same samples, read another way"),
    ("data", "bad_records"): ("applied", "a fault policy"),
    ("data", "max_bad_records"): ("applied", "a fault policy"),
    ("data", "max_consecutive_bad_records"): ("applied", "a fault policy"),
    ("loader", "batch_size"): ("refused", _SAMPLES),
    ("loader", "val_batch_size"): ("applied", "validation only"),
    ("loader", "shuffle"): ("refused", _SAMPLES),
    ("loader", "drop_last"): ("refused", _SAMPLES),
    ("loader", "sampler"): ("refused", _SAMPLES),
    ("loader", "bucket_size_multiplier"): ("refused", _SAMPLES),
    ("loader", "weights"): ("refused", _SAMPLES),
    ("loader", "num_workers"): ("refused", "seeds each worker's random transforms"),
    ("loader", "pin_memory"): ("applied", "the same batches, copied another way"),
    ("loader", "persistent_workers"): ("applied", "the same batches"),
    ("loader", "prefetch_factor"): ("applied", "the same batches"),
    ("loader", "timeout_s"): ("applied", "a fault policy"),
    ("loader", "collate_fn"): ("refused", "changes the batches"),
    ("loader", "collate_args"): ("refused", "changes the batches"),
    ("loss",): ("refused", "changes the loss being minimized"),
    ("optim", "name"): ("refused", "another optimizer cannot take this one's state"),
    ("optim", "lr"): ("adjusted", "set into the optimizer after loading"),
    ("optim", "weight_decay"): ("adjusted", "set into the optimizer after loading"),
    ("optim",): ("refused", _UPDATE),
    ("schedule",): ("refused", "changes the lr of the next steps"),
    ("train", "epochs"): ("applied", "extends or shortens the run"),
    ("train", "max_steps"): ("applied", "extends or shortens the run"),
    ("train", "grad_accum_steps"): ("refused", _UPDATE),
    ("train", "clip_grad_norm"): ("refused", _UPDATE),
    ("train", "clip_grad_value"): ("refused", _UPDATE),
    ("train", "precision"): ("refused", "changes the arithmetic of each step"),
    ("train", "device"): ("refused", "changes the arithmetic of each step"),
    ("train", "compile"): ("refused", "changes the arithmetic of each step"),
    ("train", "prefetch"): ("applied", "the same batches, copied another way"),
    ("train", "threads"): ("applied", "how many cores compute each step"),
    ("train", "task"): ("applied", "which metrics are computed"),
    ("train", "metrics"): ("applied", "which metrics are computed"),
    ("train", "step_fn"): ("refused", "changes the loss being minimized"),
    ("train", "eval_fn"): ("applied", "validation only"),
    ("callbacks",): (
        "applied",
        "your code at the loop's hooks; its state is restored by class name",
    ),
    ("train", "monitor"): ("applied", "which checkpoint counts as best"),
    ("train", "monitor_mode"): ("applied", "which checkpoint counts as best"),
    ("train", "early_stopping"): ("applied", "when the run ends"),
    ("train", "log_every_steps"): ("applied", "logging"),
    ("train", "grad_health_every"): ("applied", "logging"),
    ("train", "on_nonfinite"): ("applied", "a fault policy"),
    ("train", "max_skipped_steps"): ("applied", "a fault policy"),
    ("train", "max_rollbacks"): ("applied", "a fault policy"),
    ("train", "min_loss_scale"): ("applied", "a fault policy"),
    ("checkpoint",): ("applied", "checkpoint rotation"),
    ("tracking",): ("applied", "tracking"),
    ("distributed", "strategy"): ("refused", "changes how the weights are held and updated"),
    ("distributed",): ("applied", "communication settings"),
}
_DEFAULT: tuple[Decision, str] = ("refused", "a setting stoker does not know to be safe")


def decision(path: tuple[str, ...]) -> tuple[Decision, str]:
    """The decision for a config key: its own entry, else its nearest section's."""
    for end in range(len(path), 0, -1):
        if path[:end] in POLICY:
            return POLICY[path[:end]]
    return _DEFAULT


@dataclass
class ConfigChanges:
    """The config keys that differ between a checkpoint and now, by decision."""

    applied: list[str] = field(default_factory=list)
    adjusted: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> ConfigChanges:
    """Every key whose value differs, as ``key: old in the checkpoint, new now (why)``.

    A key the checkpoint's config lacks (a setting added to stoker since) is not judged.
    """
    changes = ConfigChanges()
    if not saved:
        return changes
    for path, before, now in _differences(_named_sampler(saved), _named_sampler(current)):
        if path == ("loader", "sampler"):  # as the configs say it
            before, now = saved["loader"]["sampler"], current["loader"]["sampler"]
        kind, why = decision(path)
        line = f"{'.'.join(path)}: {before!r} in the checkpoint, {now!r} now"
        getattr(changes, kind).append(line if kind == "adjusted" else f"{line} ({why})")
    return changes


def _named_sampler(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``loader.sampler: auto`` as the sampler it builds.

    ``auto`` is weighted with weights, random when shuffling, else sequential
    (``stoker.data.loader_checks``): naming that sampler builds the same one.
    """
    loader = config.get("loader")
    if not isinstance(loader, dict) or loader.get("sampler") != "auto":
        return config
    named = (
        "weighted"
        if loader.get("weights") is not None
        else "random"
        if loader.get("shuffle")
        else "sequential"
    )
    return {**config, "loader": {**loader, "sampler": named}}


def _differences(
    saved: Any, current: Any, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    if isinstance(saved, dict) and isinstance(current, dict) and (saved or current):
        for key in [*saved, *(k for k in current if k not in saved)]:
            if key not in saved:
                continue  # a setting the checkpoint predates
            yield from _differences(saved[key], current.get(key), (*path, str(key)))
        return
    if _plain(saved) != _plain(current):
        yield path, saved, current


def _plain(value: Any) -> Any:
    # YAML gives lists where the typed config gave tuples (betas): the same value.
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


def fresh_hyperparameters(optimizer: torch.optim.Optimizer) -> list[tuple[float, Any]]:
    """Each param group's base lr and weight decay as built from the current config.

    The base lr is ``initial_lr``: building the schedule already set ``lr`` to its first
    value (a warmup's ``1/warmup_steps`` of the base), which is not the lr configured.
    """
    return [
        (group.get("initial_lr", group["lr"]), group.get("weight_decay"))
        for group in optimizer.param_groups
    ]


def apply_hyperparameters(
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    fresh: list[tuple[float, Any]],
    *,
    saved: dict[str, Any],
    current: dict[str, Any],
) -> list[str]:
    """Set a changed ``optim.lr``/``optim.weight_decay`` into the loaded optimizer.

    ``optimizer.load_state_dict`` brought back the checkpoint's values; ``fresh`` holds
    what the current config built. The lr goes into the schedule's base (``base_lrs``,
    ``initial_lr``) and each group's current lr is the new base times the schedule's
    factor at the step reached, as if the run had started with it: the LambdaLR's factor
    at that step, or for another scheduler (a user's StepLR, which scales the lr it
    finds at each step) the loaded lr scaled by new base / old base.

    Returns:
        One message per applied change (empty when nothing changed).
    """
    old, new = saved.get("optim") or {}, current.get("optim") or {}
    messages = []
    if "lr" in old and old["lr"] != new.get("lr"):
        lambdas = getattr(scheduler, "lr_lambdas", None)
        step = getattr(scheduler, "last_epoch", 0)
        for index, (group, (lr, _)) in enumerate(zip(optimizer.param_groups, fresh, strict=True)):
            before = group.get("initial_lr")
            if lambdas:
                group["lr"] = lr * lambdas[index](step)
            elif before:
                group["lr"] = group["lr"] * (lr / before)
            else:
                group["lr"] = lr
            group["initial_lr"] = lr
        # Through the scheduler's own state dict: its base lrs and the lr it reports.
        schedule = scheduler.state_dict()
        schedule["base_lrs"] = [lr for lr, _ in fresh]
        if "_last_lr" in schedule:
            schedule["_last_lr"] = [group["lr"] for group in optimizer.param_groups]
        scheduler.load_state_dict(schedule)
        messages.append(
            f"optim.lr changed on resume: {old['lr']!r} in the checkpoint, {new.get('lr')!r} "
            f"now; the lr from step {step} on follows the schedule from the new base"
        )
    if "weight_decay" in old and old["weight_decay"] != new.get("weight_decay"):
        for group, (_, decay) in zip(optimizer.param_groups, fresh, strict=True):
            if decay is not None:
                group["weight_decay"] = decay
        messages.append(
            f"optim.weight_decay changed on resume: {old['weight_decay']!r} in the "
            f"checkpoint, {new.get('weight_decay')!r} now; applied from this step on"
        )
    for message in messages:
        logger.warning("%s", message)
    return messages


_MODEL_HINT = (
    "resume with the model the run was trained with (model.name and model.args in the run "
    "dir's config.yaml); a different model cannot continue a run, even with "
    "--allow-config-change: start a new run"
)
_OPTIM_HINT = (
    "resume with the optimizer the run was trained with (optim.name in the run dir's "
    "config.yaml); another optimizer cannot take this one's state, even with "
    "--allow-config-change: start a new run"
)


def check_optimizer_class(
    optimizer: torch.optim.Optimizer, state: dict[str, Any], *, changed: str = ""
) -> None:
    """Refuse another optimizer class's state before it is loaded.

    ``load_state_dict`` takes it without a word (the param groups are replaced), and the
    first step fails on a missing setting (``KeyError: 'momentum'``). A group whose keys
    miss some of this class's settings and hold others is another class's: keys a newer
    PyTorch added are only missing, never foreign.
    """
    expected = set(optimizer.defaults)
    name = type(optimizer).__name__
    for group in state.get("param_groups") or []:
        keys = set(group) - {"params", "param_names", "initial_lr"}
        if (expected - keys) and (keys - expected):
            raise CheckpointError(
                f"The checkpoint's optimizer state is not a {name}'s{changed}: it has "
                f"{', '.join(sorted(keys - expected))}, where a {name} has "
                f"{', '.join(sorted(expected - keys))}.",
                hint=_OPTIM_HINT,
            )


def weights_error(exc: Exception, *, model_change: str, optim_change: str) -> CheckpointError:
    """A failed load of the model's or optimizer's state, for people, naming what changed."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and "state_dict" in text:
        detail = "; ".join(line.strip() for line in text.splitlines()[1:4] if line.strip())
        return CheckpointError(
            f"The checkpoint's weights do not fit this model{model_change}: {detail or text}",
            hint=_MODEL_HINT,
        )
    return CheckpointError(
        f"The checkpoint's optimizer state does not fit this optimizer{optim_change}: "
        f"{type(exc).__name__}: {text}",
        hint=_OPTIM_HINT,
    )


def changed_keys(saved: dict[str, Any], current: dict[str, Any], section: str) -> str:
    """`` (model.args.hidden: [64] in the checkpoint, [32] now)`` for a message, or ``""``."""
    lines = [
        f"{'.'.join(path)}: {before!r} in the checkpoint, {now!r} now"
        for path, before, now in _differences(saved.get(section), current.get(section), (section,))
    ]
    return f" ({'; '.join(lines)})" if lines else ""
