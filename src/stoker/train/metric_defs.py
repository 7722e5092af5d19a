"""The built-in metrics on request (precision, recall, F1, top-k accuracy, R²) and a mean of
the user's function, each kept as sums that add up over batches and over ranks.

A figure such as F1 or R² is no mean of per-batch (or per-rank) figures: averaging them
weighs a small last batch or a rank with fewer samples wrongly, and a macro F1 of parts
is not the F1 of the whole. So every metric here keeps *sufficient statistics* — true and
false positives and false negatives per class, correct predictions and predictions
scored, per-column sums of targets, of their squares and of squared errors — which are
plain sums: a distributed evaluation all-reduces them (``stoker.train.metric_set``) and
each rank computes the figure once from the whole data set's sums.

Each metric's sums are a fixed-size ``head`` and a matrix of ``rows`` (one per class or
per output column) whose count is learned from the first batch; a rank that saw no batch
has no rows, and rows of zeros add nothing, so the reduction pads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from stoker.errors import DataError
from stoker.train.batch import batch_size_of
from stoker.train.losses import aligned_shapes

Average = Literal["auto", "binary", "macro", "micro", "weighted"]
Which = Literal["precision", "recall", "f1"]


def sums_dtype(device: torch.device) -> torch.dtype:
    """float64 for the float sums (R², means): exact enough for sums of squares; MPS has
    no float64, so float32 there."""
    return torch.float32 if device.type == "mps" else torch.float64


class SumMetric:
    """The sums of one metric: ``head`` (fixed size) and ``rows`` (``[rows, width]``)."""

    width = 0
    head_size = 0

    def __init__(self, key: str) -> None:
        self.key = key
        self.head: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        #: Another metric that keeps the same sums: this one reads its, and is not updated.
        self.leader: SumMetric | None = None

    def shares(self, other: SumMetric) -> bool:
        """Whether ``other`` keeps the very sums this one keeps."""
        return False

    def sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(head, rows), this metric's own or its leader's."""
        owner = self.leader or self
        assert owner.head is not None and owner.rows is not None, "start() first"
        return owner.head, owner.rows

    def start(self, device: torch.device, dtype: torch.dtype) -> None:
        """Make the sums on ``device``, before an evaluation's first batch."""
        with torch.inference_mode(False):  # ordinary tensors: added to in place later
            self.head = torch.zeros(self.head_size, dtype=dtype, device=device)
            self.rows = torch.zeros(0, self.width, dtype=dtype, device=device)

    def _grow(self, count: int) -> torch.Tensor:
        """``rows`` with ``count`` rows: made on the first batch, checked on later ones."""
        assert self.rows is not None
        if self.rows.shape[0] == 0:
            self.rows = torch.zeros(
                count, self.width, dtype=self.rows.dtype, device=self.rows.device
            )
        elif self.rows.shape[0] != count:
            raise DataError(
                f"metric {self.key!r}: this batch has {count} classes or output columns, "
                f"earlier ones had {self.rows.shape[0]}",
                hint="make every batch's outputs the same width (only the batch size and "
                "sequence length may change)",
            )
        return self.rows

    def update(self, outputs: Any, targets: Any) -> None:
        """Add one batch to the sums on the device (no CPU-GPU sync)."""
        raise NotImplementedError

    def values(self, head: list[float], rows: list[list[float]]) -> float | None:
        """The figure from the whole data set's sums; None when nothing was scored."""
        raise NotImplementedError


# --- classification ----------------------------------------------------------------------


def _class_pairs(
    outputs: Any, targets: Any, ignore_index: int | None, *, key: str
) -> tuple[torch.Tensor, torch.Tensor, int, bool, torch.Tensor | None]:
    """(predictions, targets, classes, multi-label, real) in one of three layouts.

    Class scores ``[N, C]`` (or ``[N, C, T]``) against integer labels ``[N]`` (``[N, T]``):
    argmax, flattened to 1-D; ``real`` marks the positions whose label is not
    ``ignore_index`` (a mask, not an index: indexing would wait for the GPU). One
    logit per sample ``[N]`` / ``[N, 1]`` against 0/1 labels: its sign, as two classes.
    ``[N, C]`` logits against as many 0/1 targets (multi-label): each logit's sign, as
    ``[N, C]`` booleans.
    """
    if not isinstance(outputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise DataError(
            f"metric {key!r} needs the model's output and the targets as tensors; got "
            f"{type(outputs).__name__} and {type(targets).__name__}",
            hint="list this metric only for models that output one tensor of class scores",
        )
    if outputs.ndim == targets.ndim + 1 and outputs.shape[1] > 1:
        if targets.is_floating_point() or outputs.shape[:1] + outputs.shape[2:] != targets.shape:
            raise _layout_error(key, outputs, targets)
        labels = targets.flatten()
        real = labels.ne(ignore_index) if ignore_index is not None else None
        return outputs.argmax(dim=1).flatten(), labels, outputs.shape[1], False, real
    aligned = aligned_shapes(outputs, targets)
    if aligned is None or aligned[0].ndim > 2:
        raise _layout_error(key, outputs, targets)
    logits, labels = aligned
    if logits.ndim == 2 and logits.shape[1] > 1:
        return logits.gt(0), labels.gt(0.5), logits.shape[1], True, None
    return logits.gt(0).long().flatten(), labels.gt(0.5).long().flatten(), 2, False, None


def _layout_error(key: str, outputs: torch.Tensor, targets: torch.Tensor) -> DataError:
    return DataError(
        f"metric {key!r}: cannot score the model's output {list(outputs.shape)} against "
        f"targets {list(targets.shape)} ({targets.dtype})",
        hint="it takes class scores [N, C] against labels [N] (or [N, C, T] against [N, T]), "
        "one logit [N] or [N, 1] against 0/1 labels, or [N, C] logits against [N, C] 0/1 "
        "targets (multi-label)",
    )


class ClassCounts(SumMetric):
    """Precision, recall or F1 from true positives, false positives and false negatives
    per class (rows ``[tp, fp, fn]``); the head counts single- and multi-label batches,
    and labels past the model's classes.

    ``average``: ``binary`` reports class ``positive`` alone; ``micro`` pools the counts
    of every class (for single-label data, precision = recall = F1 = accuracy);
    ``macro`` is the mean of the per-class figures over the classes present in the
    targets or the predictions (scikit-learn's and torchmetrics' rule); ``weighted``
    weighs them by each class's count in the targets; ``auto`` is binary for two classes
    (one logit, or two scores), macro otherwise. A class with no predictions (precision)
    or no targets (recall) scores 0, as scikit-learn's ``zero_division=0``.
    """

    width = 3
    head_size = 3

    def __init__(
        self,
        key: str,
        which: Which,
        *,
        average: Average = "auto",
        positive: int = 1,
        beta: float = 1.0,
        ignore_index: int | None = None,
    ) -> None:
        super().__init__(key)
        self.which, self.average, self.positive = which, average, positive
        self.beta, self.ignore_index = beta, ignore_index

    def shares(self, other: SumMetric) -> bool:
        """Precision, recall and F1 count the same: one set of counts serves them all."""
        return isinstance(other, ClassCounts) and other.ignore_index == self.ignore_index

    def update(self, outputs: Any, targets: Any) -> None:
        """Add the batch's per-class counts of predictions and labels."""
        predicted, labels, classes, multilabel, real = _class_pairs(
            outputs, targets, self.ignore_index, key=self.key
        )
        rows = self._grow(classes)
        assert self.head is not None
        self.head[1 if multilabel else 0] += 1
        if multilabel:
            tp = predicted.logical_and(labels).sum(0)
            fp = predicted.logical_and(labels.logical_not()).sum(0)
            fn = labels.logical_and(predicted.logical_not()).sum(0)
        else:
            confusion, outside = _confusion(labels, predicted, real, classes)
            self.head[2] += outside
            tp = confusion.diagonal()
            fp = confusion.sum(0) - tp  # predicted as the class, labelled otherwise
            fn = confusion.sum(1) - tp
        rows += torch.stack((tp, fp, fn), dim=1).to(rows.dtype)

    def values(self, head: list[float], rows: list[list[float]]) -> float | None:
        """The figure from the counts; a DataError when batches mixed single- and multi-label."""
        single, multi, past = head
        if past:
            raise _past_classes(self.key, len(rows))
        if single and multi:
            raise DataError(
                f"metric {self.key!r}: some batches are single-label and some multi-label",
                hint="make every batch's outputs and targets the same layout",
            )
        if not rows or not any(any(row) for row in rows):
            return None
        average = self.average
        if average == "auto":
            average = "binary" if len(rows) == 2 and not multi else "macro"
        if average == "binary":
            if not 0 <= self.positive < len(rows):
                raise DataError(
                    f"metric {self.key!r}: positive class {self.positive} is not one of the "
                    f"{len(rows)} classes",
                    hint=f"set its args.positive to a class index below {len(rows)}",
                )
            return self._figure(*rows[self.positive])
        if average == "micro":
            return self._figure(*(sum(row[i] for row in rows) for i in range(3)))
        present = [row for row in rows if any(row)]  # in the targets or the predictions
        figures = [self._figure(*row) for row in present]
        if average == "macro":
            return sum(figures) / len(figures)
        support = [tp + fn for tp, _, fn in present]
        total = sum(support)
        return sum(f * s for f, s in zip(figures, support, strict=True)) / total if total else 0.0

    def _figure(self, tp: float, fp: float, fn: float) -> float:
        if self.which == "precision":
            return tp / (tp + fp) if tp + fp else 0.0
        if self.which == "recall":
            return tp / (tp + fn) if tp + fn else 0.0
        b2 = self.beta**2
        denominator = (1 + b2) * tp + b2 * fn + fp
        return (1 + b2) * tp / denominator if denominator else 0.0


def _past_classes(key: str, classes: int) -> DataError:
    return DataError(
        f"metric {key!r}: some labels are no class: negative, or {classes} or more, but "
        f"the model scores {classes} classes (0 to {classes - 1})",
        hint="make the model's last layer as wide as the number of classes; padding must "
        "equal loss.ignore_index",
    )


def _confusion(
    labels: torch.Tensor, predicted: torch.Tensor, real: torch.Tensor | None, classes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[classes, classes]`` confusion counts (label, prediction), and how many real
    positions have a label that is no class (negative, or ``classes`` or more).

    Counted into a fixed ``[classes + 1]²`` grid — left-out positions (``real`` False)
    and labels outside the classes go to the extra class — with ``index_add_``: unlike
    ``bincount``, which sizes its result from the data, it never waits for the GPU.
    """
    outside = labels.lt(0).logical_or_(labels.ge(classes))
    if real is not None:
        outside.logical_and_(real)
        predicted = predicted.where(real, classes)
        labels = labels.where(real.logical_and(outside.logical_not()), classes)
    else:
        labels = labels.where(outside.logical_not(), classes)
    size = classes + 1
    index = labels * size + predicted
    grid = torch.zeros(size * size, dtype=torch.long, device=index.device)
    grid.index_add_(0, index, torch.ones_like(index))
    return grid.view(size, size)[:classes, :classes], outside.sum()


class TopKAccuracy(SumMetric):
    """The share of predictions whose label is among the ``k`` highest class scores;
    the head holds (correct, scored). Positions labelled ``ignore_index`` are left out."""

    head_size = 2

    def __init__(self, key: str, k: int, *, ignore_index: int | None = None) -> None:
        super().__init__(key)
        self.k, self.ignore_index = k, ignore_index

    def update(self, outputs: Any, targets: Any) -> None:
        """Add the batch's count of targets among the top ``k`` predictions."""
        if self.k == 1:
            predicted, labels, _, multilabel, real = _class_pairs(
                outputs, targets, self.ignore_index, key=self.key
            )
            if multilabel:
                raise _layout_error(self.key, outputs, targets)
            hits, scored = predicted.eq(labels), labels.numel()
            if real is not None:
                hits, scored = hits.logical_and(real), real.sum()
        else:
            if not (
                isinstance(outputs, torch.Tensor)
                and isinstance(targets, torch.Tensor)
                and outputs.ndim == targets.ndim + 1
                and not targets.is_floating_point()
                and outputs.shape[:1] + outputs.shape[2:] == targets.shape
            ):
                raise _layout_error(self.key, outputs, targets)
            if self.k > outputs.shape[1]:
                raise DataError(
                    f"metric {self.key!r}: the model scores {outputs.shape[1]} classes, fewer "
                    f"than k={self.k}",
                    hint=f"use top<k>_accuracy with k at most {outputs.shape[1]}",
                )
            top = outputs.topk(self.k, dim=1).indices
            hits = top.eq(targets.unsqueeze(1)).any(dim=1)
            scored = hits.numel()
            if self.ignore_index is not None:
                real = targets.ne(self.ignore_index)
                hits, scored = hits.logical_and(real), real.sum()
        assert self.head is not None
        self.head[0] += hits.sum()
        self.head[1] += scored

    def values(self, head: list[float], rows: list[list[float]]) -> float | None:
        """Correct over scored; None when nothing was scored."""
        correct, scored = head
        return correct / scored if scored else None


# --- regression --------------------------------------------------------------------------


class RSquared(SumMetric):
    """R², the coefficient of determination, per output column from rows
    ``[count, Σy, Σy², Σ(y - ŷ)²]``; ``average``: ``uniform`` (the mean of the columns'
    R², scikit-learn's default) or ``variance_weighted``. A column of constant targets
    scores 1 when predicted exactly, else 0 (scikit-learn's ``force_finite``)."""

    width = 4

    def __init__(
        self, key: str, *, average: Literal["uniform", "variance_weighted"] = "uniform"
    ) -> None:
        super().__init__(key)
        self.average = average

    def update(self, outputs: Any, targets: Any) -> None:
        """Add the batch's per-output sums that R² needs."""
        aligned = None
        if isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor):
            aligned = aligned_shapes(outputs, targets)
        if aligned is None:
            raise DataError(
                f"metric {self.key!r}: the model's output {_shape(outputs)} and the targets "
                f"{_shape(targets)} are not one shape",
                hint="r2 compares predictions with targets of the same shape ([N] against "
                "[N, 1] is aligned)",
            )
        rows = self.rows
        assert rows is not None
        predicted, real = (t.reshape(t.shape[0], -1).to(rows.dtype) for t in aligned)
        sums = torch.stack(
            (
                torch.full((real.shape[1],), real.shape[0], dtype=rows.dtype, device=rows.device),
                real.sum(0),
                real.square().sum(0),
                (real - predicted).square().sum(0),
            ),
            dim=1,
        )
        self._grow(real.shape[1]).add_(sums)

    def values(self, head: list[float], rows: list[list[float]]) -> float | None:
        """R² per output, averaged as ``average`` says; None when nothing was scored."""
        rows = [row for row in rows if row[0]]
        if not rows:
            return None
        residual = [row[3] for row in rows]
        total = [max(row[2] - row[1] ** 2 / row[0], 0.0) for row in rows]
        if self.average == "variance_weighted" and sum(total):
            return 1.0 - sum(residual) / sum(total)
        scores = [
            1.0 - res / tot if tot else (1.0 if res == 0 else 0.0)
            for res, tot in zip(residual, total, strict=True)
        ]
        return sum(scores) / len(scores)


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


# --- the user's function -----------------------------------------------------------------


class MeanOf(SumMetric):
    """A function ``(outputs, targets) -> number`` averaged over samples: the head holds
    (Σ value × batch size, Σ batch size), so the figure is the mean a whole-set call
    would give for any per-sample mean (an error rate, a mean distance) — but not for a
    figure like F1 or AUROC, which no mean of batches gives (use a torchmetrics object)."""

    head_size = 2

    def __init__(self, key: str, function: Callable[..., Any], *, name: str) -> None:
        super().__init__(key)
        self.function, self.name = function, name

    def update(self, outputs: Any, targets: Any) -> None:
        """Add the user function's value for the batch, weighted by its samples."""
        if isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor):
            outputs, targets = aligned_shapes(outputs, targets) or (outputs, targets)
        try:
            value = self.function(outputs, targets)
        except Exception as error:
            raise DataError(
                f"metric {self.key!r} ({self.name}) failed on outputs {_shape(outputs)} and "
                f"targets {_shape(targets)}: {type(error).__name__}: {error}",
                hint="a metric function takes (outputs, targets) of one batch and returns "
                "one number (a 0-d tensor or a float)",
            ) from error
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(float(value))
        if value.numel() != 1:
            raise DataError(
                f"metric {self.key!r} ({self.name}) returned a tensor of shape "
                f"{list(value.shape)}; a metric is one number per batch",
                hint="reduce it to one number, e.g. return values.mean()",
            )
        assert self.head is not None
        count = batch_size_of(targets)
        self.head[0] += value.detach().reshape(()).to(self.head) * count
        self.head[1] += count

    def values(self, head: list[float], rows: list[list[float]]) -> float | None:
        """The sample-weighted mean over the batches; None when there were none."""
        total, count = head
        return total / count if count else None
