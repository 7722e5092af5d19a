"""User callbacks: the hooks the loop calls, their order, their errors and their state.

A callback is any object with some of the methods of :class:`Callback` (no base class
to inherit). The loop calls, in this order:

- ``on_train_start(loop)`` once, after a resume has restored everything;
- ``on_step_end(loop, step)`` after each optimizer step (and the lr schedule's step),
  before that step's checkpoint;
- ``on_validation_end(loop, metrics)`` after each validation, with the ``val/`` metrics;
- ``on_epoch_end(loop, record)`` with the epoch's whole record, before it is logged
  (a key a callback adds is logged with it) and before the epoch's checkpoint;
- ``on_checkpoint(loop, path)`` after each checkpoint is written;
- ``on_train_end(loop)`` once, when training ends without an error.

Callbacks run in the order given (those a config names first, then those passed to
``stoker.fit``). Per-step work is dispatched through lists built once, so a run with no
callback calls one empty function per step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from stoker.errors import CallbackError, ConfigError

if TYPE_CHECKING:
    from stoker.train.loop import Loop

__all__ = ["HOOKS", "Callback", "CallbackError", "Callbacks", "StepRecord", "check_plain"]

#: The hooks, in the order a run calls them.
HOOKS = (
    "on_train_start",
    "on_step_end",
    "on_validation_end",
    "on_epoch_end",
    "on_checkpoint",
    "on_train_end",
)


@dataclass(frozen=True)
class StepRecord:
    """What ``on_step_end`` is told about the optimizer step just taken.

    Attributes:
        step: Optimizer steps done, this one included.
        epoch: The epoch being trained, from 1.
        batch: Batches of this epoch consumed so far.
        loss: The step's mean loss, a 0-d tensor on the training device (``float()`` of
            it waits for the GPU: read it every few steps, not every step, on a GPU).
        lr: The learning rate of the first parameter group, after the schedule's step.
        metrics: A ``step_fn``'s other outputs for this step, as ``train/<name>``
            tensors (means over the step's micro-batches); empty with the built-in loss.
    """

    step: int
    epoch: int
    batch: int
    loss: torch.Tensor
    lr: float
    metrics: Mapping[str, torch.Tensor] = field(default_factory=dict)


@runtime_checkable
class Callback(Protocol):
    """Every hook a callback may have; a callback defines any subset of them.

    A callback that keeps state across steps (a counter, a running mean) and must
    survive a resume also defines ``state_dict() -> dict`` and ``load_state_dict(state)``:
    the state is saved in every checkpoint and loaded before ``on_train_start`` on
    resume. It must be plain data and tensors (what ``torch.load(weights_only=True)``
    accepts): dicts, lists, tuples, str, int, float, bool, None.

    ``loop.log({"my/metric": value})`` writes to the run's sinks (metrics.jsonl,
    TensorBoard, MLflow); ``loop.request_stop("why")`` ends the run after the current
    step, with a checkpoint saved to resume from.
    """

    def on_train_start(self, loop: Loop) -> None:
        """Once, before the first step, after a resume has restored everything."""

    def on_step_end(self, loop: Loop, step: StepRecord) -> None:
        """After each optimizer step and the schedule's step; runs every step, so keep it cheap."""

    def on_validation_end(self, loop: Loop, metrics: dict[str, Any]) -> None:
        """After each validation, with its ``val/`` metrics."""

    def on_epoch_end(self, loop: Loop, record: dict[str, Any]) -> None:
        """With the epoch's record, before it is logged and before the epoch's checkpoint."""

    def on_checkpoint(self, loop: Loop, path: Path) -> None:
        """After each checkpoint is written to the folder ``path`` (on rank 0)."""

    def on_train_end(self, loop: Loop) -> None:
        """Once, when training ends without an error (also after a requested stop)."""


def _nothing(*args: Any) -> None:
    """The hook of a run without callbacks: one call, no work."""


class Callbacks:
    """The run's callbacks, dispatched hook by hook in the order they were given."""

    def __init__(self, callbacks: Sequence[object] = ()) -> None:
        self.callbacks = list(callbacks)
        for callback in self.callbacks:
            if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise ConfigError(
                    f"callback {_name(callback)} has none of the hooks {', '.join(HOOKS)}",
                    hint="define at least one of them (see stoker.train.callbacks.Callback)",
                )
        self._hooks = {
            hook: [c for c in self.callbacks if callable(getattr(c, hook, None))] for hook in HOOKS
        }
        #: Called by the loop after every optimizer step; a no-op without step callbacks.
        self.step_end: Callable[..., None] = (
            self._step_end if self._hooks["on_step_end"] else _nothing
        )

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, loop: Loop, *args: Any) -> None:
        """Call ``hook`` on each callback that has it; an error names the callback."""
        for callback in self._hooks[hook]:
            _call(callback, hook, loop, *args)

    def _step_end(self, loop: Loop, metrics: Any, batch: int) -> None:
        state = loop.state
        take = getattr(metrics, "take_step", None)
        assert loop.step_loss is not None  # the step that just ended set it
        record = StepRecord(
            step=state.step,
            epoch=state.epoch_number,
            batch=batch,
            loss=loop.step_loss,
            lr=loop.optimizer.param_groups[0]["lr"],
            metrics=take() if take is not None else {},
        )
        self.call("on_step_end", loop, record)

    # --- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Each stateful callback's state, under a key made of its class name."""
        states = {}
        for key, callback in self._keyed():
            if callable(getattr(callback, "state_dict", None)):
                state = _call(callback, "state_dict", None)
                check_plain(state, where=f"callback {_name(callback)}.state_dict()")
                states[key] = state
        return states

    def load_state_dict(self, states: Mapping[str, Any] | None) -> list[str]:
        """Load saved states into the callbacks with the same key; returns warnings.

        A stateful callback with no saved state starts afresh, and a saved state with no
        callback to take it is dropped: both are reported, neither stops the resume.
        """
        states = dict(states or {})
        warnings = []
        for key, callback in self._keyed():
            if not callable(getattr(callback, "load_state_dict", None)):
                continue
            if key in states:
                _call(callback, "load_state_dict", None, states.pop(key))
            elif callable(getattr(callback, "state_dict", None)):
                warnings.append(f"callback {key} has no state in the checkpoint: it starts afresh")
        warnings += [
            f"the checkpoint holds state of callback {key}, not given now" for key in states
        ]
        return warnings

    def _keyed(self) -> list[tuple[str, object]]:
        """(key, callback): the class name, with ``#2``, ``#3`` for repeats of a class."""
        seen: dict[str, int] = {}
        keyed = []
        for callback in self.callbacks:
            name = type(callback).__qualname__
            seen[name] = seen.get(name, 0) + 1
            keyed.append((name if seen[name] == 1 else f"{name}#{seen[name]}", callback))
        return keyed


def _call(callback: object, hook: str, loop: Loop | None, *args: Any) -> Any:
    try:
        method = getattr(callback, hook)
        return method(loop, *args) if loop is not None else method(*args)
    except CallbackError:
        raise
    except Exception as error:
        where = ""
        if loop is not None:
            where = f" at step {loop.state.step} (epoch {loop.state.epoch_number})"
        raise CallbackError(
            f"callback {_name(callback)}.{hook} raised {type(error).__name__}: {error}{where}; "
            "the run stopped",
            hint="fix the callback (rerun with --debug for its traceback); the last "
            "checkpoint, if any, resumes the run",
        ) from error


def _name(callback: object) -> str:
    return type(callback).__qualname__


_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def check_plain(value: Any, *, where: str) -> None:
    """Raise a CallbackError unless ``value`` is what a weights-only checkpoint holds."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise CallbackError(f"{where}: key {key!r} is a {type(key).__name__}")
            check_plain(item, where=f"{where}[{key!r}]")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_plain(item, where=f"{where}[{index}]")
        return
    raise CallbackError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot hold safely",
        hint="return plain data: dicts, lists, str, int, float, bool, None and tensors "
        "(e.g. torch.from_numpy(array), float(x))",
    )
