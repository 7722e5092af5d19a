"""TaskMetrics: what it reports, whether batches are held and folded or added one by one."""

from __future__ import annotations

import math

import pytest
import torch

from stoker.train import metrics as metrics_module
from stoker.train.metrics import TaskMetrics


def _batches(kind: str, steps: int = 40, seed: int = 0):
    """(outputs, targets, mean loss, count) per batch; the last batch is smaller."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        n = 5 if step == steps - 1 else 8
        if kind == "classes":
            outputs = torch.randn(n, 3, generator=generator)
            targets = torch.randint(0, 3, (n,), generator=generator)
        elif kind == "tokens":
            outputs = torch.randn(n, 4, 6, generator=generator)
            targets = torch.randint(0, 4, (n, 6), generator=generator)
            targets[:, -2:] = -100  # padding
        elif kind == "binary":
            outputs = torch.randn(n, 1, generator=generator)
            targets = torch.randint(0, 2, (n, 1), generator=generator).float()
        else:  # regression
            outputs = torch.randn(n, 2, generator=generator)
            targets = torch.randn(n, 2, generator=generator)
        loss = torch.rand((), generator=generator)
        count = int((targets != -100).sum()) if kind == "tokens" else n
        out.append((outputs, targets, loss, count))
    return out


def _expected(kind: str, batches) -> dict[str, float]:
    """The metrics worked out directly, batch by batch, in float64."""
    samples = sum(count for *_, count in batches)
    loss = sum(loss.item() * count for _, _, loss, count in batches) / samples
    expected = {"val/loss": loss}
    if kind == "regression":
        errors = torch.cat([(o - t).double().flatten() for o, t, _, _ in batches])
        expected["val/mse"] = errors.square().sum().item() / samples
        expected["val/mae"] = errors.abs().sum().item() / samples
        return expected
    correct = 0
    for outputs, targets, _, _ in batches:
        if kind == "binary":
            correct += int(((outputs > 0) == (targets > 0.5)).sum())
        else:
            correct += int(((outputs.argmax(1) == targets) & (targets != -100)).sum())
    expected["val/accuracy"] = correct / samples
    return expected


def _compute(kind: str, batches, monkeypatch=None, hold: int | None = None):
    if hold is not None:
        monkeypatch.setattr(metrics_module, "_HOLD_STEPS", hold)
    task = "regression" if kind == "regression" else "classification"
    metrics = TaskMetrics(task, ignore_index=-100 if kind == "tokens" else None)
    for batch in batches:
        metrics.update(*batch)
    return metrics.compute("val")


@pytest.mark.parametrize("kind", ["classes", "tokens", "binary", "regression"])
def test_held_batches_report_what_batch_by_batch_sums_do(kind, monkeypatch) -> None:
    batches = _batches(kind)
    held = _compute(kind, batches)  # 40 small batches: all held until compute
    one_by_one = _compute(kind, batches, monkeypatch, hold=1)
    expected = _expected(kind, batches)
    assert held.keys() == one_by_one.keys() == expected.keys()
    for key, value in expected.items():
        assert held[key] == pytest.approx(value, rel=1e-6), key
        assert one_by_one[key] == pytest.approx(value, rel=1e-6), key
    if "val/accuracy" in expected:  # a count: exact whichever way it is summed
        assert held["val/accuracy"] == one_by_one["val/accuracy"] == expected["val/accuracy"]


def test_batches_are_folded_once_the_hold_is_full(monkeypatch) -> None:
    monkeypatch.setattr(metrics_module, "_HOLD_STEPS", 16)
    metrics = TaskMetrics("classification")
    for batch in _batches("classes", steps=40):
        metrics.update(*batch)
        assert len(metrics._held) < 16  # memory stays bounded over a long epoch
    assert metrics.samples == 39 * 8 + 5


def test_large_outputs_are_added_batch_by_batch(monkeypatch) -> None:
    monkeypatch.setattr(metrics_module, "_HOLD_ELEMENTS", 10)  # less than one batch's 24
    metrics = TaskMetrics("classification")
    for batch in _batches("classes", steps=5):
        metrics.update(*batch)
        assert not metrics._held


def test_token_batches_of_different_lengths_are_folded_one_by_one() -> None:
    batches = _batches("tokens", steps=6)
    batches[2] = (batches[2][0][:, :, :3], batches[2][1][:, :3], batches[2][2], 16)
    assert _compute("tokens", batches) == pytest.approx(_expected("tokens", batches))


def test_the_task_is_inferred_from_the_first_batch() -> None:
    classes = TaskMetrics(None)
    classes.update(*_batches("classes", steps=1)[0])
    assert classes.task == "classification" and "val/accuracy" in classes.compute("val")
    regression = TaskMetrics(None)
    regression.update(*_batches("regression", steps=1)[0])
    assert regression.task == "regression" and "val/mse" in regression.compute("val")


def test_outputs_without_a_class_layout_report_the_loss_only() -> None:
    metrics = TaskMetrics("classification")
    metrics.update(torch.randn(4, 3), torch.randn(4, 5), torch.tensor(0.5), 4)
    assert metrics.compute("train") == {"train/loss": pytest.approx(0.5)}


def test_state_dict_holds_the_held_batches_and_a_restore_drops_later_ones() -> None:
    batches = _batches("classes", steps=10)
    metrics = TaskMetrics("classification")
    for batch in batches[:6]:
        metrics.update(*batch)
    state = metrics.state_dict()
    assert set(state) == {
        "task",
        "loss_sum",
        "correct",
        "abs_err",
        "sq_err",
        "samples",
        "has_accuracy",
    }
    assert state["loss_sum"].dtype == torch.float32 and state["correct"].dtype == torch.long
    assert state["samples"] == 48 and state["has_accuracy"]

    resumed = TaskMetrics("classification")
    resumed.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
    for batch in batches[6:]:
        resumed.update(*batch)
    whole = _expected("classes", batches)
    assert resumed.compute("val") == pytest.approx(whole, rel=1e-6)

    metrics.update(torch.randn(8, 3), torch.zeros(8, dtype=torch.long), torch.tensor(math.nan), 8)
    metrics.load_state_dict(state)  # a skipped step's NaN loss is held, then dropped
    assert math.isfinite(metrics.compute("val")["val/loss"])
    assert metrics.samples == 48


def test_updates_are_detached_and_keep_no_graph() -> None:
    weight = torch.randn(3, 3, requires_grad=True)
    outputs = torch.randn(8, 3) @ weight
    loss = outputs.square().mean()
    metrics = TaskMetrics("classification")
    metrics.update(outputs, torch.zeros(8, dtype=torch.long), loss, 8)
    metrics.update(outputs, torch.zeros(8, dtype=torch.long), loss, 8)
    assert metrics._held  # the second batch is held (the first one was folded)
    assert all(not o.requires_grad and not held.requires_grad for o, _, held, _ in metrics._held)
    assert not metrics.loss_sum().requires_grad


def test_batches_held_under_inference_mode_are_folded_after_it() -> None:
    batches = _batches("classes", steps=6)
    with torch.inference_mode():  # as evaluate() runs; compute comes after it
        metrics = TaskMetrics(None)
        for batch in batches:
            metrics.update(*batch)
    assert metrics._held
    assert metrics.compute("val") == pytest.approx(_expected("classes", batches))
