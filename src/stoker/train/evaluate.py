"""Validation: the model over a loader under ``torch.inference_mode``, with task metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from stoker.data.device import move_to_device
from stoker.train.batch import batch_size_of, forward, split_batch
from stoker.train.metric_set import NO_METRICS, Metrics
from stoker.train.metrics import Task, TaskMetrics
from stoker.train.precision import Precision


def evaluate(
    model: nn.Module,
    loader: Iterable,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    device: torch.device,
    precision: Precision,
    task: Task | None,
    prefix: str = "val",
    ignore_index: int | None = None,
    metrics: Metrics = NO_METRICS,
) -> dict[str, float]:
    """Loss and, by task, accuracy (classification) or MSE and MAE (regression), then
    the run's other ``metrics`` (``train.metrics``).

    With ``ignore_index`` (token-level losses) batches are weighted by their real tokens.
    The model is put back in training mode afterwards if it was in it. In a distributed
    run every rank calls this on its share of the data, and every rank gets the whole
    data set's figures.
    """
    was_training = model.training
    model.eval()
    task_metrics = TaskMetrics(task, ignore_index=ignore_index, loss_fn=loss_fn)
    # The positions the loss skips are left out of the other metrics too.
    extra = metrics.start(device=device, ignore_index=task_metrics.ignore_index)
    try:
        with torch.inference_mode():
            for batch in loader:
                inputs, targets = split_batch(move_to_device(batch, device))
                with precision.autocast():
                    outputs = forward(model, inputs)
                    loss = loss_fn(outputs, targets)
                count = (
                    int((targets != ignore_index).sum())
                    if ignore_index is not None
                    else batch_size_of(targets)
                )
                task_metrics.update(outputs, targets, loss, count)
                extra.update(outputs, targets)
    finally:
        model.train(was_training)
    values = task_metrics.compute(prefix)
    values.update(extra.compute(prefix, reported=values))
    return values
