"""Steps 3 and 4 of a micro-batch, forward and loss: the built-in pair or a user's step_fn.

The loop asks the run's objective to split a batch into what is moved to the device and
counted, and then to turn it into ``(outputs, loss)``. :class:`LossStep` is
``model(inputs)`` then ``loss_fn(outputs, targets)``; :class:`UserStep` hands the whole
batch to ``step_fn(model, batch)``, which returns the loss, or a dict with ``"loss"``
and other values (more losses, metrics) that are logged as ``train/<name>`` and
``val/<name>``. Fetch, transfer, precision, accumulation, clipping, timing, checkpoints
and resume stay the loop's either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from stoker.data.device import move_to_device
from stoker.data.samplers import rank_and_world_size
from stoker.errors import DataError, StokerError
from stoker.train.batch import batch_size_of, explain_loss_failure, forward, split_batch
from stoker.train.evaluate import evaluate
from stoker.train.metrics import TaskMetrics
from stoker.train.precision import Precision

if TYPE_CHECKING:
    from stoker.train.loop import Loop

#: ``step_fn(model, batch)``: the loss, or a dict of it (``"loss"``) and other values.
StepFn = Callable[[nn.Module, Any], "torch.Tensor | Mapping[str, Any]"]


class LossStep:
    """The built-in objective: the model's forward, then the loop's loss function.

    It reads the loss and ``normalize`` from the loop at each call, so a loop changed
    after it was built (as tests do) is followed.
    """

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.split = split_batch

    def count(self, inputs: Any, targets: Any) -> int:
        """What a micro-batch's loss is averaged over: its samples, or its real tokens."""
        loop = self.loop
        if loop.normalize == "tokens":
            # Targets are still on the host here, so counting costs no device sync.
            return int((targets != loop.ignore_index).sum())
        return batch_size_of(targets)

    def take(self, batch: Any) -> tuple[Any, Any, int]:
        """``(inputs, targets, count)``: ``split`` and ``count`` in one call.

        The common batch, an ``(inputs, targets)`` tuple counted in samples, is taken
        here without the two calls (a Python call costs about as much as a small
        tensor op's dispatch, on every micro-batch).
        """
        kind = type(batch)
        if (kind is tuple or kind is list) and len(batch) >= 2 and self.loop.normalize == "samples":
            inputs, targets = batch[0], batch[1]
            if type(targets) is torch.Tensor and targets.ndim:
                return inputs, targets, targets.shape[0]
        inputs, targets = self.split(batch)
        return inputs, targets, self.count(inputs, targets)

    def __call__(self, model: nn.Module, inputs: Any, targets: Any) -> tuple[Any, torch.Tensor]:
        """``(outputs, loss)`` of one micro-batch: the model's forward, then the loss."""
        outputs = forward(model, inputs)
        try:
            return outputs, self.loop.loss_fn(outputs, targets)
        except (RuntimeError, ValueError, IndexError) as error:
            raise explain_loss_failure(
                error, outputs, targets, loss_name=self.loop.loss_name
            ) from error

    def metrics(self, metrics: TaskMetrics) -> TaskMetrics:
        """The task's own metrics, unchanged."""
        return metrics


class UserStep:
    """A user's ``step_fn(model, batch)`` in place of forward and loss."""

    def __init__(self, step_fn: StepFn, *, field: str = "step_fn") -> None:
        self.step_fn = step_fn
        self.field = field
        self.name = getattr(step_fn, "__qualname__", type(step_fn).__name__)

    def split(self, batch: Any) -> tuple[Any, None]:
        """The whole batch is the step function's; there are no separate targets."""
        return batch, None

    def count(self, inputs: Any, targets: Any) -> int:
        """The micro-batch's samples, which weight its loss in the step."""
        return samples_in(inputs)

    def take(self, batch: Any) -> tuple[Any, None, int]:
        """``(batch, None, samples)``: ``split`` and ``count`` in one call."""
        return batch, None, samples_in(batch)

    def __call__(
        self, model: nn.Module, inputs: Any, targets: Any
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``(other outputs, loss)`` of one micro-batch, the other outputs detached."""
        try:
            result = self.step_fn(model, inputs)
        except (StokerError, torch.OutOfMemoryError):
            raise  # already for people, or not the function's bug (the batch is too large)
        except Exception as error:
            raise StokerError(
                f"{self.field} {self.name} raised {type(error).__name__}: {error}",
                hint="fix the step function (rerun with --debug for its traceback)",
            ) from error
        return split_result(result, where=f"{self.field} {self.name}")

    def metrics(self, metrics: TaskMetrics) -> StepFnMetrics:
        """The task's metrics, plus the means of the step function's other outputs."""
        return StepFnMetrics(metrics)


def split_result(result: Any, *, where: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A step function's result as (other values detached, the loss)."""
    if isinstance(result, torch.Tensor):
        loss, others = result, {}
    elif isinstance(result, Mapping):
        if "loss" not in result:
            raise StokerError(
                f"{where} returned a dict without 'loss' (keys: {sorted(result)})",
                hint="return {'loss': total_loss, ...}: the loop backpropagates 'loss'",
            )
        loss = result["loss"]
        others = {
            str(name): torch.as_tensor(value).detach()
            for name, value in result.items()
            if name != "loss"
        }
    else:
        raise StokerError(
            f"{where} returned a {type(result).__name__}",
            hint="return the loss tensor, or a dict {'loss': tensor, 'other': value, ...}",
        )
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        got = f"shape {list(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss)
        raise StokerError(
            f"{where}: the loss must be a 0-d tensor, got {got}",
            hint="reduce it to the batch's mean (loss.mean())",
        )
    for name, value in others.items():
        if value.numel() != 1:
            raise StokerError(
                f"{where}: output {name!r} has shape {list(value.shape)}; other outputs are "
                "logged as metrics, so each must be one number",
                hint=f"return {name!r} as a mean (value.mean()), or leave it out",
            )
    return others, loss


def samples_in(batch: Any) -> int:
    """Samples in a batch: the first dimension of the first tensor in it."""
    for tensor in _tensors(batch):
        if tensor.ndim > 0:
            return int(tensor.shape[0])
    raise DataError("cannot tell the batch size: the batch holds no tensor with a dimension")


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class StepFnMetrics:
    """The loss (through TaskMetrics, task ``none``) and a step function's other outputs.

    Each other output is summed times the micro-batch's samples, on the device, and
    reported as its mean over the epoch's samples. ``take_step`` gives the means since
    the last call (one optimizer step's, for ``on_step_end``).
    """

    def __init__(self, inner: TaskMetrics) -> None:
        self.inner = inner
        self._sums: dict[str, torch.Tensor] = {}
        self._step: dict[str, torch.Tensor] = {}
        self._step_samples = 0

    @property
    def samples(self) -> int:
        """Samples counted so far."""
        return self.inner.samples

    def update(self, outputs: Any, targets: Any, loss: torch.Tensor, count: int) -> None:
        """Add one micro-batch: its loss and the other outputs, weighted by ``count`` samples."""
        self.inner.update(loss, None, loss, count)
        for name, value in outputs.items():
            weighted = value.float() * count
            self._sums[name] = self._sums[name] + weighted if name in self._sums else weighted
            self._step[name] = self._step[name] + weighted if name in self._step else weighted
        self._step_samples += count

    def take_step(self) -> dict[str, torch.Tensor]:
        """The other outputs' means since the last call, as ``train/<name>``."""
        samples, self._step_samples = self._step_samples, 0
        step, self._step = self._step, {}
        return {f"train/{name}": value / max(samples, 1) for name, value in step.items()}

    def compute(self, prefix: str) -> dict[str, float]:
        """The means under ``prefix/``: the loss, the task's metrics and each other output."""
        values = self.inner.compute(prefix)
        if not self._sums:
            return values
        names = sorted(self._sums)
        device = self._sums[names[0]].device
        sums = torch.stack([self._sums[name].to(device, torch.float64) for name in names])
        samples = torch.tensor([float(self.inner.samples)], dtype=torch.float64, device=device)
        totals = torch.cat([sums, samples])
        if rank_and_world_size()[1] > 1:
            dist.all_reduce(totals)
        *figures, n = totals.tolist()
        if n:
            values.update(
                {f"{prefix}/{name}": s / n for name, s in zip(names, figures, strict=True)}
            )
        return values

    def loss_sum(self) -> torch.Tensor:
        """The summed loss so far, on the device (reading it waits for the GPU)."""
        return self.inner.loss_sum()

    def state_dict(self) -> dict[str, Any]:
        """The running sums, so a run resumed mid-epoch reports the whole epoch."""
        return {
            "loss": self.inner.state_dict(),
            "outputs": {name: value.detach().cpu() for name, value in self._sums.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A state of this class, or a plain TaskMetrics one (an epoch not started)."""
        if "outputs" not in state:
            self.inner.load_state_dict(state)
            self._sums = {}
            return
        self.inner.load_state_dict(state["loss"])
        device = self.inner.device  # no fold: the held batches fold where they would
        self._sums = {name: value.to(device) for name, value in state["outputs"].items()}

    def snapshot(self) -> tuple[Any, ...]:
        """The sums as they are, for ``restore`` when a step is skipped or rolled back."""
        # The sums are replaced, never changed in place: references are a snapshot.
        return self.inner.snapshot(), dict(self._sums), dict(self._step), self._step_samples

    def restore(self, snapshot: tuple[Any, ...]) -> None:
        """Go back to a ``snapshot``."""
        inner, sums, step, self._step_samples = snapshot
        self.inner.restore(inner)
        self._sums, self._step = dict(sums), dict(step)


def evaluate_steps(
    model: nn.Module,
    loader: Iterable,
    step: UserStep,
    *,
    device: torch.device,
    precision: Precision,
    prefix: str = "val",
) -> dict[str, float]:
    """Validation with a user's ``eval_fn`` (or ``step_fn``) under ``inference_mode``."""
    was_training = model.training
    model.eval()
    metrics = StepFnMetrics(TaskMetrics("none"))
    try:
        with torch.inference_mode():
            for batch in loader:
                inputs, targets = step.split(move_to_device(batch, device))
                with precision.autocast():
                    outputs, loss = step(model, inputs, targets)
                metrics.update(outputs, targets, loss, step.count(inputs, targets))
    finally:
        model.train(was_training)
    return metrics.compute(prefix)


def validate(loop: Loop, loader: Iterable | None = None, *, prefix: str = "val") -> dict[str, Any]:
    """The validation metrics: the built-in loss and task metrics, or a user's eval_fn.

    ``loader`` defaults to the run's validation data; the test split passes its own
    (with ``prefix="test"``), so that it is measured as validation is.
    """
    loader = loop.val_loader if loader is None else loader
    own = loop.eval_fn or loop.step_fn
    if own is not None:
        field_name = "eval_fn" if loop.eval_fn is not None else "step_fn"
        return evaluate_steps(
            loop.model,
            loader,  # type: ignore[arg-type]
            UserStep(own, field=field_name),
            device=loop.device,
            precision=loop.precision,
            prefix=prefix,
        )
    return evaluate(
        loop.model,
        loader,  # type: ignore[arg-type]
        loop.loss_fn,
        device=loop.device,
        precision=loop.precision,
        task=loop.task,
        prefix=prefix,
        ignore_index=loop.ignore_index if loop.normalize == "tokens" else None,
        metrics=loop.metrics,
    )
