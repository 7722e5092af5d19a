"""The batch contract: how a batch splits into model inputs and targets."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from stoker.errors import DataError, StokerError


def split_batch(batch: Any) -> tuple[Any, torch.Tensor]:
    """Split a batch into ``(inputs, targets)``.

    A tuple or list is ``(inputs, targets, *extra)``: extra fields (metadata) ride
    along unused. A mapping holds ``inputs`` and ``targets`` keys.
    """
    kind = type(batch)
    if (kind is tuple or kind is list) and len(batch) >= 2:  # the common case, checked first
        return batch[0], batch[1]
    if isinstance(batch, Mapping):
        if "inputs" in batch and "targets" in batch:
            return batch["inputs"], batch["targets"]
        raise DataError(
            f"a dict batch needs the keys 'inputs' and 'targets', got {sorted(batch)}",
            hint="return {'inputs': ..., 'targets': ...} from the dataset or collate_fn",
        )
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[0], batch[1]
    raise DataError(
        f"a batch must be (inputs, targets, ...) or a dict; got {_describe(batch)}",
        hint="make the dataset return (features, label) pairs",
    )


def forward(model: nn.Module, inputs: Any) -> torch.Tensor:
    """Call the model: a dict of inputs as keyword arguments, anything else as one argument.

    Raises:
        ModelError: The model raised; the error names the module that failed, the input
            it got, what it expects and the fix, and has the original as its cause. The
            ``try`` costs nothing until something is raised (no hooks are installed).
    """
    try:
        if type(inputs) is not torch.Tensor and isinstance(inputs, Mapping):
            return model(**inputs)
        return model(inputs)
    except (StokerError, torch.OutOfMemoryError):
        raise  # already for people, or not the model's bug (the batch is too large)
    except Exception as error:
        from stoker.train.model_errors import explain_model_failure  # only on this path

        raise explain_model_failure(error, model, inputs) from error


def batch_size_of(targets: Any) -> int:
    """Samples in a batch, read from the targets' first dimension."""
    if isinstance(targets, torch.Tensor) and targets.ndim > 0:
        return targets.shape[0]
    if isinstance(targets, (list, tuple)):
        return len(targets)
    raise DataError(f"cannot tell the batch size from targets of type {_describe(targets)}")


def explain_loss_failure(
    error: Exception, outputs: Any, targets: Any, *, loss_name: str
) -> DataError:
    """Turn a loss that failed on the first batch into an error a person can act on."""
    message = (
        f"the model's output does not fit the targets for loss {loss_name!r}: "
        f"output {_describe(outputs)}, targets {_describe(targets)}"
    )
    hint = "make the model's last layer match the labels"
    if (
        isinstance(outputs, torch.Tensor)
        and isinstance(targets, torch.Tensor)
        and outputs.ndim == 2
        and not targets.is_floating_point()
        and targets.numel()
    ):
        classes = int(targets.max().item()) + 1
        if classes > outputs.shape[1]:
            hint = (
                f"labels go up to {classes - 1}, so the model needs at least {classes} outputs "
                f"(e.g. model.args.out_features={classes}); it has {outputs.shape[1]}"
            )
    return DataError(f"{message} ({type(error).__name__}: {error})", hint=hint)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor shape {list(value.shape)} dtype {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__
