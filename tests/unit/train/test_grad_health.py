"""Tests for stoker.train.grad_health, on values small enough to check by hand."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from stoker.train.grad_health import (
    GradHealth,
    layer_grad_norms,
    snapshot_weights,
    update_to_weight_ratios,
)


def _model(bias: float = 2.0) -> nn.Module:
    """Linear(2 -> 1) with w = [3, 4] (||w|| = 5) and b = [bias]."""
    model = nn.Sequential(nn.Linear(2, 1))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[3.0, 4.0]]))
        model[0].bias.fill_(bias)
    return model


def _set_grads(model: nn.Module, weight: list[float], bias: float) -> None:
    model[0].weight.grad = torch.tensor([weight])
    model[0].bias.grad = torch.tensor([bias])


def test_layer_grad_norms_are_per_parameter_l2_norms() -> None:
    model = _model()
    _set_grads(model, [6.0, 8.0], -12.0)
    norms = layer_grad_norms(model)
    assert list(norms) == ["0.weight", "0.bias"]
    assert norms["0.weight"].item() == pytest.approx(10.0)
    assert norms["0.bias"].item() == pytest.approx(12.0)
    assert norms["0.weight"].dtype == torch.float32
    assert norms["0.weight"].ndim == 0


def test_parameters_without_a_gradient_or_frozen_are_left_out() -> None:
    model = nn.Sequential(nn.Linear(2, 1), nn.Linear(1, 1))
    model[0].weight.grad = torch.ones(1, 2)
    model[1].requires_grad_(False)
    model[1].weight.grad = torch.ones(1, 1)  # frozen: not reported even with a grad
    assert list(layer_grad_norms(model)) == ["0.weight"]


def test_half_precision_gradients_do_not_overflow() -> None:
    layer = nn.Linear(3, 1, bias=False).to(torch.float16)
    # Every element fits fp16 (max 65,504) but the norm, 60,000 * sqrt(3), does not.
    layer.weight.grad = torch.full((1, 3), 60000.0, dtype=torch.float16)
    norm = layer_grad_norms(layer)["weight"]
    assert norm.dtype == torch.float32
    assert norm.item() == pytest.approx(60000 * math.sqrt(3), rel=1e-3)


def test_sparse_gradients_are_measured() -> None:
    embedding = nn.Embedding(4, 3, sparse=True)
    embedding(torch.tensor([0, 0])).sum().backward()  # row 0 gets 1 + 1 in each of 3 columns
    assert embedding.weight.grad.is_sparse
    assert layer_grad_norms(embedding)["weight"].item() == pytest.approx(2 * math.sqrt(3))


def test_compiled_model_reports_the_plain_names() -> None:
    model = _model()
    _set_grads(model, [3.0, 4.0], 1.0)
    compiled = torch.compile(model)  # not run: only its parameter names matter here
    assert list(layer_grad_norms(compiled)) == ["0.weight", "0.bias"]


def test_update_to_weight_ratio_is_step_norm_over_weight_norm() -> None:
    model = _model(bias=2.0)
    before = snapshot_weights(model)
    with torch.no_grad():
        model[0].weight -= torch.tensor([[0.3, 0.4]])  # ||Δw|| = 0.5, ||w|| = 5
        model[0].bias += 0.1  # ||Δb|| = 0.1, ||b|| = 2
    ratios = update_to_weight_ratios(model, before)
    assert ratios["0.weight"].item() == pytest.approx(0.1)
    assert ratios["0.bias"].item() == pytest.approx(0.05)
    # The snapshot is a copy, not a view of the live weights.
    assert before["0.weight"].tolist() == [[3.0, 4.0]]


def test_update_ratio_of_an_all_zero_weight_is_nan() -> None:
    model = _model(bias=0.0)
    before = snapshot_weights(model)
    with torch.no_grad():
        model[0].bias += 0.1
    ratios = update_to_weight_ratios(model, before)
    assert math.isnan(ratios["0.bias"].item())
    assert ratios["0.weight"].item() == 0.0


def test_should_sample_every_n_steps_from_zero() -> None:
    health = GradHealth(3, optimizer_kind="sgd")
    assert [step for step in range(8) if health.should_sample(step)] == [0, 3, 6]


def test_sampled_step_records_norms_and_update_ratios() -> None:
    model = _model(bias=2.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    health = GradHealth(2, optimizer_kind="sgd")
    _set_grads(model, [3.0, 4.0], 1.0)

    health.before_step(model, 0)
    optimizer.step()  # Δw = 0.1 * [3, 4] -> 0.5; Δb = 0.1 * 1 -> 0.1
    record = health.after_step(model)

    assert record == pytest.approx(
        {
            "grad/layer/0.weight": 5.0,
            "grad/layer/0.bias": 1.0,
            "update_ratio/0.weight": 0.5 / 5.0,
            "update_ratio/0.bias": 0.1 / 2.0,
        }
    )
    assert all(type(value) is float for value in record.values())
    assert health.after_step(model) == {}  # read once; the weight copy is gone


def test_norms_are_taken_before_clipping() -> None:
    model = _model()
    health = GradHealth(1, optimizer_kind="sgd", update_ratios=False)
    _set_grads(model, [30.0, 40.0], 0.0)
    health.before_step(model, 0)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    record = health.after_step(model)
    assert record["grad/layer/0.weight"] == pytest.approx(50.0)
    assert not any(key.startswith("update_ratio/") for key in record)


def test_steps_off_the_sample_record_nothing() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    health = GradHealth(2, optimizer_kind="sgd")
    health.before_step(model, 0)  # sampled, but the next step is not: the state is reset
    _set_grads(model, [3.0, 4.0], 1.0)
    health.before_step(model, 1)
    optimizer.step()
    assert health.after_step(model) == {}


def _clipping(health: GradHealth, pattern: list[bool]) -> GradHealth:
    for clipped in pattern:
        health.observe_clip(clipped)
    return health


def test_adam_clipped_on_nearly_every_step_warns_to_lower_the_lr() -> None:
    health = _clipping(GradHealth(optimizer_kind="AdamW"), [True] * 18 + [False] * 2)
    assert health.clip_rate() == pytest.approx(0.9)
    (warning,) = health.warnings()
    assert "90% of the last 20 steps" in warning
    assert "adamw" in warning
    assert "Lower optim.lr" in warning


def test_no_clip_warning_below_the_threshold_or_the_window() -> None:
    # 17 of 20 steps (85%) is below 90%.
    assert _clipping(GradHealth(optimizer_kind="adam"), [True] * 17 + [False] * 3).warnings() == []
    # 19 steps are too few to judge, even when all were clipped.
    assert _clipping(GradHealth(optimizer_kind="adam"), [True] * 19).warnings() == []
    # SGD: clipping by norm does shrink its step, so there is nothing to warn about.
    assert _clipping(GradHealth(optimizer_kind="sgd"), [True] * 50).warnings() == []


def test_clip_rate_covers_only_the_recent_window() -> None:
    health = _clipping(GradHealth(optimizer_kind="adam", clip_window=20), [True] * 40)
    assert len(health.warnings()) == 1
    _clipping(health, [False] * 20)
    assert health.clip_rate() == 0.0
    assert health.warnings() == []


def test_clip_flags_may_be_device_tensors() -> None:
    health = GradHealth(optimizer_kind="adam")
    norms = torch.tensor([2.0, 0.5, 3.0, 4.0])
    for norm in norms:
        health.observe_clip(norm > 1.0)  # as the loop would: no .item() per step
    health.observe_clip(False)
    assert health.clip_rate() == pytest.approx(3 / 5)
    assert GradHealth(optimizer_kind="adam").clip_rate() is None


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="every_n_steps=-1"):
        GradHealth(-1, optimizer_kind="adam")
    off = GradHealth(0, optimizer_kind="adam")
    assert not any(off.should_sample(step) for step in range(5))
    with pytest.raises(ValueError, match="never be judged"):
        GradHealth(optimizer_kind="adam", clip_window=10)
