"""Elementwise losses over the shapes users write, and what the metrics read from a loss.

A regression model usually ends in ``nn.Linear(..., 1)``, so its output is ``(N, 1)``,
while the targets read from a table are ``(N,)``. ``nn.MSELoss`` broadcasts the two to
``(N, N)`` — every output against every target — with only a warning, and the model
learns the targets' mean. The built-in elementwise losses here align the two shapes as
the user meant (a view, no copy) and refuse any other mismatch with an error naming both
shapes; the task metrics align predictions and targets by the same rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stoker.errors import DataError


def aligned_shapes(
    outputs: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``outputs`` and ``targets`` as views of one shape, or None when they have none.

    Equal shapes are kept; a trailing dimension of size 1 on either side (``(N, 1)``
    against ``(N,)``, ``(N, T, 1)`` against ``(N, T)``) is dropped. Nothing else is
    guessed: any other pair would broadcast or fail, and is the caller's to report.
    """
    out_shape, target_shape = outputs.shape, targets.shape
    if out_shape == target_shape:
        return outputs, targets
    if out_shape[:-1] == target_shape and out_shape[-1:] == (1,):
        return outputs.squeeze(-1), targets
    if target_shape[:-1] == out_shape and target_shape[-1:] == (1,):
        return outputs, targets.squeeze(-1)
    return None


def shape_mismatch(
    outputs: torch.Tensor, targets: torch.Tensor, *, what: str, alternative: str = ""
) -> DataError:
    """The error for outputs and targets that no trailing 1 aligns, naming both shapes.

    ``alternative`` is appended to the hint: another fix where there is one.
    """
    out_shape, target_shape = list(outputs.shape), list(targets.shape)
    try:
        spread = list(torch.broadcast_shapes(outputs.shape, targets.shape))
        effect = (
            f"PyTorch would broadcast them to {spread} and compare outputs with the "
            "targets of other samples"
        )
    except RuntimeError:
        effect = "they do not match element for element"
    return DataError(
        f"{what}: the model's output has shape {out_shape} and the targets {target_shape}; "
        f"{effect}",
        hint=(
            f"make the model output {target_shape} or {[*target_shape, 1]} "
            f"(one value per target), or the targets {out_shape}{alternative}"
        ),
    )


def align_for_loss(
    outputs: Any, targets: Any, *, loss_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """What an elementwise loss gets: aligned shapes, floating-point targets.

    Integer or bool targets (counts, ratings, 0/1 labels) are cast to float32 (float64
    with float64 outputs): an elementwise loss needs floating-point targets, and float32
    holds every integer up to 2**24 exactly (a bfloat16 cast under autocast would not).
    """
    if not (isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor)):
        return outputs, targets  # the loss itself says what it cannot take
    if not targets.is_floating_point():
        targets = targets.to(torch.promote_types(outputs.dtype, torch.float32))
    aligned = aligned_shapes(outputs, targets)
    if aligned is None:
        raise shape_mismatch(outputs, targets, what=f"loss {loss_name!r}")
    return aligned


class _Aligned:
    """Mixin: align the pair, then the PyTorch loss's own ``forward``.

    A subclass of the PyTorch loss rather than a wrapper around it: the same attributes
    and ``isinstance``, and no second module call on every micro-batch.
    """

    loss_name = ""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        input, target = align_for_loss(input, target, loss_name=self.loss_name)
        return super().forward(input, target)  # type: ignore[misc]


class MSELoss(_Aligned, nn.MSELoss):
    """``nn.MSELoss`` over aligned shapes (``loss.name: mse``)."""

    loss_name = "mse"


class L1Loss(_Aligned, nn.L1Loss):
    """``nn.L1Loss`` over aligned shapes (``loss.name: l1``)."""

    loss_name = "l1"


class SmoothL1Loss(_Aligned, nn.SmoothL1Loss):
    """``nn.SmoothL1Loss`` over aligned shapes (``loss.name: smooth_l1``)."""

    loss_name = "smooth_l1"


class HuberLoss(_Aligned, nn.HuberLoss):
    """``nn.HuberLoss`` over aligned shapes (``loss.name: huber``)."""

    loss_name = "huber"


class BCEWithLogitsLoss(_Aligned, nn.BCEWithLogitsLoss):
    """``nn.BCEWithLogitsLoss`` over aligned shapes, integer 0/1 labels allowed."""

    loss_name = "bce_with_logits"


class CrossEntropyLoss(nn.CrossEntropyLoss):
    """``nn.CrossEntropyLoss`` that refuses floating-point targets it cannot mean.

    PyTorch reads floating-point targets of the output's shape as class probabilities.
    Regression targets given to the default loss look just like that: with a model that
    ends in ``nn.Linear(..., 1)`` the "probabilities" are over one class, the loss is 0
    on every step, and the run ends with exit code 0 and ``loss 0.0000``. So floating
    targets are accepted only as what they can be: per-class probabilities, over two
    classes or more, in the output's shape. Two attribute reads per call; the checks
    that need the values (probabilities in [0, 1]) are left to PyTorch.
    """

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The cross entropy, after the floating-target checks above."""
        if target.is_floating_point():
            _refuse_float_targets(input, target)
        # nn.CrossEntropyLoss.forward's own call, made here rather than through super():
        # the loss then costs the step no Python call more than PyTorch's class does.
        return F.cross_entropy(
            input,
            target,
            weight=self.weight,
            ignore_index=self.ignore_index,
            reduction=self.reduction,
            label_smoothing=self.label_smoothing,
        )


def _refuse_float_targets(outputs: torch.Tensor, targets: torch.Tensor) -> None:
    out_shape, target_shape = list(outputs.shape), list(targets.shape)
    if out_shape == target_shape and outputs.ndim >= 2 and out_shape[1] >= 2:
        return  # class probabilities (soft labels, mixup): what PyTorch means
    regression = (
        "for regression set the loss to mse, l1 or huber (loss.name in a config, "
        "stoker.fit(..., loss='mse')); for classification give integer class labels"
    )
    if out_shape == target_shape:
        raise DataError(
            f"loss 'cross_entropy': the targets are floating point ({targets.dtype}) and "
            f"the model gives one score per sample (output {out_shape}): cross entropy "
            "over a single class is 0 whatever the model does, so nothing would be learned",
            hint=f"{regression} and a model with one output per class",
        )
    raise DataError(
        f"loss 'cross_entropy': the targets are floating point ({targets.dtype}, shape "
        f"{target_shape}) against the model's output {out_shape}: cross entropy takes "
        "integer class labels, or class probabilities in the output's shape",
        hint=f"{regression} (from a table: target_dtype: int64 in the source's args)",
    )


#: PyTorch's elementwise losses, as objects or functions, and the names they go by.
_ELEMENTWISE: dict[Any, str] = {
    nn.MSELoss: "mse",
    nn.L1Loss: "l1",
    nn.SmoothL1Loss: "smooth_l1",
    nn.HuberLoss: "huber",
    nn.BCEWithLogitsLoss: "bce_with_logits",
    F.mse_loss: "mse",
    F.l1_loss: "l1",
    F.smooth_l1_loss: "smooth_l1",
    F.huber_loss: "huber",
    F.binary_cross_entropy_with_logits: "bce_with_logits",
}


class AlignedLoss(nn.Module):
    """A user's own PyTorch elementwise loss (``loss=nn.MSELoss()``), aligned the same way.

    It wraps the object (its weights stay the user's); only PyTorch's own classes and
    functions are wrapped, never a subclass, whose ``forward`` may mean other shapes.
    """

    def __init__(self, loss: Callable[..., torch.Tensor], *, name: str) -> None:
        super().__init__()
        self.loss = loss  # a Module is registered as a child, so .to() reaches its buffers
        self.loss_name = name

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The wrapped loss of ``outputs`` and ``targets`` brought to the shapes it expects."""
        outputs, targets = align_for_loss(outputs, targets, loss_name=self.loss_name)
        return self.loss(outputs, targets)


def align_user_loss(loss: Callable[..., Any]) -> Callable[..., Any]:
    """``loss`` aligned when it is one of PyTorch's elementwise losses, else ``loss`` itself."""
    key = type(loss) if isinstance(loss, nn.Module) else loss
    try:
        name = _ELEMENTWISE.get(key)
    except TypeError:  # an unhashable callable: not one of them
        return loss
    return AlignedLoss(loss, name=name) if name is not None else loss


def loss_ignore_index(loss: Any) -> int | None:
    """The target value a cross-entropy or NLL loss skips (None for other losses)."""
    if isinstance(loss, AlignedLoss):
        return None
    if isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)):
        return loss.ignore_index
    if loss is F.cross_entropy or loss is F.nll_loss:
        return -100  # their default
    return None


def is_plain_cross_entropy(loss: Any) -> bool:
    """Whether ``loss`` is the mean negative log-likelihood of the targets, unweighted.

    Perplexity is exp of that mean, so only then is it reported: class weights make the
    mean a weighted one and label smoothing adds a term, so exp of either is no
    perplexity; a subclass or a user's function may compute anything.
    """
    if loss is F.cross_entropy:
        return True
    return (
        type(loss) in (nn.CrossEntropyLoss, CrossEntropyLoss)
        and loss.weight is None
        and loss.label_smoothing == 0
        and loss.reduction == "mean"
    )
