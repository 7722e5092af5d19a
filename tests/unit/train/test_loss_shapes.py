"""The built-in elementwise losses take the shapes users write, and refuse broadcasting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stoker
from stoker.components import build_loss
from stoker.config import validate_config
from stoker.errors import DataError
from stoker.train.losses import AlignedLoss, align_user_loss

OUTPUTS = torch.tensor([1.0, 2.0, 4.0, -1.0])
TARGETS = torch.tensor([1.5, 2.0, 1.0, 0.0])  # errors -0.5, 0, 3, -1

#: Each elementwise built-in and its value on OUTPUTS against TARGETS, worked out by hand.
BY_HAND = {
    "mse": (0.25 + 0 + 9 + 1) / 4,
    "l1": (0.5 + 0 + 3 + 1) / 4,
    # 0.5 x^2 where |x| < 1, else |x| - 0.5 (beta = delta = 1)
    "smooth_l1": (0.125 + 0 + 2.5 + 0.5) / 4,
    "huber": (0.125 + 0 + 2.5 + 0.5) / 4,
}


def _loss(name: str, **args):
    return build_loss(validate_config({"loss": {"name": name, "args": args}}, source="test"))


@pytest.mark.parametrize("name", sorted(BY_HAND))
@pytest.mark.parametrize(
    ("out_shape", "target_shape"), [((4, 1), (4,)), ((4,), (4, 1)), ((4,), (4,)), ((4, 1), (4, 1))]
)
def test_regression_losses_align_a_trailing_1(name, out_shape, target_shape) -> None:
    outputs = OUTPUTS.reshape(out_shape).requires_grad_()
    loss = _loss(name)(outputs, TARGETS.reshape(target_shape))
    assert loss.item() == pytest.approx(BY_HAND[name])
    loss.backward()
    assert outputs.grad is not None and outputs.grad.shape == out_shape


def test_bce_with_logits_aligns_and_takes_integer_labels() -> None:
    logits = torch.tensor([[0.0], [0.0], [2.0]])
    loss = _loss("bce_with_logits")(logits, torch.tensor([1, 0, 1]))
    # -ln sigmoid(0), -ln(1 - sigmoid(0)), -ln sigmoid(2)
    by_hand = (2 * torch.log(torch.tensor(2.0)) + torch.log1p(torch.exp(torch.tensor(-2.0)))) / 3
    assert loss.item() == pytest.approx(by_hand.item())


def test_integer_regression_targets_are_cast_to_float32() -> None:
    outputs = torch.tensor([[1.0], [2.0]], dtype=torch.bfloat16)
    loss = _loss("mse")(outputs, torch.tensor([3, 2]))  # counts or ratings read as ints
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("out_shape", "target_shape", "spread"),
    [
        ((4, 3), (4,), None),
        ((4, 1), (1, 4), [4, 4]),
        ((4,), (4, 2), None),
        ((4, 2), (4, 1), [4, 2]),
    ],
)
@pytest.mark.parametrize("name", [*sorted(BY_HAND), "bce_with_logits"])
def test_shapes_that_would_broadcast_are_an_error(name, out_shape, target_shape, spread) -> None:
    with pytest.raises(DataError) as info:
        _loss(name)(torch.zeros(out_shape), torch.zeros(target_shape))
    text = str(info.value)
    assert text.startswith(
        f"loss {name!r}: the model's output has shape {list(out_shape)} "
        f"and the targets {list(target_shape)}"
    )
    assert (f"broadcast them to {spread}" in text) is (spread is not None)
    assert f"make the model output {list(target_shape)}" in text


def test_cross_entropy_skips_the_configured_ignore_index() -> None:
    assert _loss("cross_entropy").ignore_index == -100
    config = validate_config({"loss": {"name": "nll", "ignore_index": 0}}, source="test")
    assert build_loss(config).ignore_index == 0
    config = validate_config(
        {"loss": {"name": "cross_entropy", "ignore_index": 0, "args": {"ignore_index": 5}}},
        source="test",
    )
    assert build_loss(config).ignore_index == 5  # the loss's own args win


def test_pytorch_losses_given_as_objects_are_aligned_too() -> None:
    for loss in (nn.MSELoss(), torch.nn.functional.mse_loss):
        aligned = align_user_loss(loss)
        assert isinstance(aligned, AlignedLoss)
        value = aligned(OUTPUTS.reshape(4, 1), TARGETS)
        assert value.item() == pytest.approx(BY_HAND["mse"])

    class Own(nn.MSELoss):  # a subclass may mean other shapes: left as it is
        pass

    own = Own()
    assert align_user_loss(own) is own
    assert align_user_loss(nn.CrossEntropyLoss) is nn.CrossEntropyLoss


@pytest.mark.parametrize("loss", ["mse", nn.MSELoss()], ids=["by-name", "object"])
def test_fit_on_n_by_1_outputs_reports_the_true_mae(loss, tmp_path) -> None:
    """A Linear(3, 1) regression with (N,) targets: it learns, and val/mae is the MAE of
    the trained model's predictions (it was 0.0000, with a broadcast loss, before)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 3, generator=generator)
    y = x @ torch.tensor([1.5, -2.0, 0.5]) + 0.3 + 0.05 * torch.randn(96, generator=generator)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    result = stoker.fit(
        model,
        (x[:64], y[:64]),
        (x[64:], y[64:]),
        loss=loss,
        epochs=8,
        batch_size=16,
        lr=0.1,
        optimizer="sgd",
        seed=0,
        progress="quiet",
        tensorboard=False,
        run_dir=tmp_path / "run",
    )
    with torch.no_grad():
        errors = result.model(x[64:]).squeeze(-1) - y[64:]
    mae, mse = errors.abs().mean().item(), errors.square().mean().item()
    assert result.metrics["val/mae"] == pytest.approx(mae, rel=1e-5)
    assert result.metrics["val/mse"] == pytest.approx(mse, rel=1e-5)
    assert result.metrics["val/loss"] == pytest.approx(mse, rel=1e-5)
    # It learned: well below the error of predicting the mean (what a broadcast loss learns).
    mean_mae = (y[64:] - y[:64].mean()).abs().mean().item()
    assert 0 < mae < 0.25 * mean_mae


@pytest.mark.parametrize(
    ("out_shape", "target_shape", "words"),
    [
        ((4, 1), (4, 1), "cross entropy over a single class is 0"),
        ((4,), (4,), "cross entropy over a single class is 0"),
        ((4, 3), (4,), "integer class labels, or class probabilities"),
        ((4, 1), (4,), "integer class labels, or class probabilities"),
    ],
)
def test_cross_entropy_refuses_float_targets_it_cannot_mean(out_shape, target_shape, words):
    """Regression targets given to the default loss: PyTorch reads them as probabilities
    (over one class the loss is 0 on every step) or fails with its own message."""
    with pytest.raises(DataError, match=words) as caught:
        _loss("cross_entropy")(torch.zeros(out_shape), torch.rand(target_shape))
    assert "mse" in caught.value.hint and "integer class labels" in caught.value.hint


def test_cross_entropy_takes_class_probabilities_and_labels() -> None:
    outputs = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    soft = torch.tensor([[0.8, 0.2, 0.0], [0.0, 0.5, 0.5]])
    labels = torch.tensor([0, 2])
    expected_soft = -(soft * outputs.log_softmax(1)).sum(1).mean()
    expected_hard = -outputs.log_softmax(1)[[0, 1], labels].mean()
    loss = _loss("cross_entropy")
    assert loss(outputs, soft).item() == pytest.approx(expected_soft.item())
    assert loss(outputs, labels).item() == pytest.approx(expected_hard.item())


def test_fit_with_float_targets_and_the_default_loss_says_to_set_a_regression_loss(tmp_path):
    """It trained to 'loss 0.0000' with exit code 0 before: soft-label cross entropy."""
    x = torch.linspace(-3, 3, 64).unsqueeze(1)
    with pytest.raises(DataError, match="single class") as caught:
        stoker.fit(
            nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)),
            (x, torch.sin(x)),
            epochs=1,
            batch_size=16,
            progress="quiet",
            tensorboard=False,
            run_dir=tmp_path / "run",
        )
    assert "loss='mse'" in caught.value.hint
