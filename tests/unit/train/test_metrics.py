"""TaskMetrics: what it reports, whether batches are held and folded or added one by one."""

from __future__ import annotations

import math

import pytest
import torch

from stoker.errors import DataError
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
        # Means over every predicted value (two per sample here), as MSELoss takes them.
        errors = torch.cat([(o - t).double().flatten() for o, t, _, _ in batches])
        expected["val/mse"] = errors.square().mean().item()
        expected["val/mae"] = errors.abs().mean().item()
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


@pytest.mark.parametrize("hold", [None, 1])
@pytest.mark.parametrize("kind", ["classes", "tokens", "regression"])
def test_a_loss_given_as_a_host_number_reports_as_the_tensor_does(kind, hold, monkeypatch) -> None:
    # The loop's plain step hands over the loss its non-finite check read (a float).
    batches = _batches(kind)
    numbers = [(outputs, targets, loss.item(), n) for outputs, targets, loss, n in batches]
    as_tensors = _compute(kind, batches, monkeypatch, hold=hold)
    as_numbers = _compute(kind, numbers, monkeypatch, hold=hold)
    assert as_numbers.keys() == as_tensors.keys()
    for key, value in as_tensors.items():
        assert as_numbers[key] == pytest.approx(value, rel=1e-6), key


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
    outputs, targets = batches[2][0][:, :, :3], batches[2][1][:, :3]
    batches[2] = (outputs, targets, batches[2][2], int((targets != -100).sum()))
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
        "scored",
        "abs_err",
        "sq_err",
        "nll_sum",
        "tokens",
        "samples",
        "scoring",
        "perplexity",
        "batches",
        "held",
        "hold",
    }
    assert state["loss_sum"].dtype == torch.float32 and state["correct"].dtype == torch.long
    assert state["samples"] == 48 and state["scoring"]
    # Batch 1 is folded (it sets how many to hold); batches 2-6 are saved as held.
    assert state["scored"].item() == 8 and len(state["held"]) == 5

    resumed = TaskMetrics("classification")
    resumed.load_state_dict({k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
    for batch in batches[6:]:
        resumed.update(*batch)
    whole = _expected("classes", batches)
    assert resumed.compute("val") == pytest.approx(whole, rel=1e-6)
    straight = TaskMetrics("classification")
    for batch in batches:
        straight.update(*batch)
    assert resumed.compute("val") == straight.compute("val")  # folded alike: bitwise

    metrics.update(torch.randn(8, 3), torch.zeros(8, dtype=torch.long), torch.tensor(math.nan), 8)
    metrics.load_state_dict(state)  # a skipped step's NaN loss is held, then dropped
    assert math.isfinite(metrics.compute("val")["val/loss"])
    assert metrics.samples == 48


def test_saving_the_state_mid_epoch_does_not_change_the_sums_bitwise() -> None:
    """A run checkpointed every step reports what the same run with no checkpoint does."""
    for kind, task in (("classes", "classification"), ("regression", "regression")):
        batches = _batches(kind, steps=40)
        saved, plain = TaskMetrics(task), TaskMetrics(task)
        for batch in batches:
            saved.update(*batch)
            saved.state_dict()
            plain.update(*batch)
        assert saved.compute("train") == plain.compute("train"), kind


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


# --- every figure against a hand computation -----------------------------------------------

HOLDS = [pytest.param(None, id="held"), pytest.param(1, id="one-at-a-time")]


def _metrics(batches, monkeypatch, hold, task, **kwargs) -> TaskMetrics:
    if hold is not None:
        monkeypatch.setattr(metrics_module, "_HOLD_STEPS", hold)
    metrics = TaskMetrics(task, **kwargs)
    for batch in batches:
        metrics.update(*batch)
    return metrics


@pytest.mark.parametrize("hold", HOLDS)
def test_multiclass_loss_and_accuracy_by_hand(hold, monkeypatch) -> None:
    batches = [
        # argmax 0, 1 against 0, 1: both right; mean loss 0.5 over 2 samples
        (torch.tensor([[2.0, 1, 0], [0, 3, 1]]), torch.tensor([0, 1]), torch.tensor(0.5), 2),
        # argmax 2, 0, 1 against 0, 1, 1: one right; mean loss 2.0 over 3 samples
        (
            torch.tensor([[1.0, 0, 5], [4, 0, 0], [0, 2, 1]]),
            torch.tensor([0, 1, 1]),
            torch.tensor(2.0),
            3,
        ),
    ]
    metrics = _metrics(batches, monkeypatch, hold, "classification")
    assert metrics.compute("val") == {"val/loss": (0.5 * 2 + 2.0 * 3) / 5, "val/accuracy": 3 / 5}


@pytest.mark.parametrize("hold", HOLDS)
@pytest.mark.parametrize("ignore_index", [-100, None], ids=["tokens", "samples"])
def test_token_accuracy_leaves_out_the_loss_ignore_index_by_hand(
    hold, ignore_index, monkeypatch
) -> None:
    """Per-token logits [N, C, T]: accuracy is over real tokens, whether the loss is
    normalized by tokens (ignore_index given) or by samples (the loss's own is used)."""
    # Argmax per position: sample 0 -> [0, 2, 1, 1], sample 1 -> [2, 2, 0, 0].
    outputs = torch.tensor(
        [
            [[5.0, 0, 0, 0], [0, 0, 9, 9], [0, 7, 0, 0]],
            [[0.0, 0, 8, 8], [0, 0, 0, 0], [9, 9, 0, 0]],
        ]
    )
    targets = torch.tensor([[0, 1, -100, -100], [2, 2, 0, -100]])  # 5 real tokens, 4 right
    count = 5 if ignore_index is not None else 2
    metrics = _metrics(
        [(outputs, targets, torch.tensor(1.0), count)],
        monkeypatch,
        hold,
        "classification",
        ignore_index=ignore_index,
        loss_fn=torch.nn.CrossEntropyLoss(),
    )
    assert metrics.compute("val")["val/accuracy"] == 4 / 5


@pytest.mark.parametrize("hold", HOLDS)
@pytest.mark.parametrize(
    ("out_shape", "target_shape"), [((4, 1), (4,)), ((4,), (4, 1)), ((4, 1), (4, 1)), ((4,), (4,))]
)
def test_binary_logit_accuracy_by_hand(hold, out_shape, target_shape, monkeypatch) -> None:
    outputs = torch.tensor([2.0, -1.0, 0.5, -3.0]).reshape(out_shape)  # says 1, 0, 1, 0
    targets = torch.tensor([1.0, 1.0, 0.0, 0.0]).reshape(target_shape)
    batches = [(outputs, targets, torch.tensor(0.25), 4)] * 2
    metrics = _metrics(batches, monkeypatch, hold, "classification")
    assert metrics.compute("train") == {"train/loss": 0.25, "train/accuracy": 0.5}


@pytest.mark.parametrize("hold", HOLDS)
def test_one_logit_against_integer_labels_is_binary_not_an_argmax(hold, monkeypatch) -> None:
    """argmax over a single logit is always 0: that would score the share of class 0."""
    outputs = torch.tensor([[3.0], [-2.0], [1.0], [2.0]])
    targets = torch.tensor([1, 0, 0, 1])  # signs say 1, 0, 1, 1: three right (argmax: two)
    metrics = _metrics([(outputs, targets, torch.tensor(0.1), 4)], monkeypatch, hold, None)
    assert metrics.compute("val")["val/accuracy"] == 3 / 4


@pytest.mark.parametrize("hold", HOLDS)
def test_regression_mse_and_mae_by_hand_with_an_n_by_1_output(hold, monkeypatch) -> None:
    batches = [
        # errors -0.5, 0, 3
        (torch.tensor([[1.0], [2.0], [4.0]]), torch.tensor([1.5, 2.0, 1.0]), torch.tensor(3.0), 3),
        # errors 1, -2
        (torch.tensor([[0.0], [0.0]]), torch.tensor([-1.0, 2.0]), torch.tensor(2.5), 2),
    ]
    metrics = _metrics(batches, monkeypatch, hold, "regression")
    assert metrics.compute("val") == pytest.approx(
        {
            "val/loss": (3.0 * 3 + 2.5 * 2) / 5,
            "val/mse": (0.25 + 0 + 9 + 1 + 4) / 5,
            "val/mae": (0.5 + 0 + 3 + 1 + 2) / 5,
        }
    )
    assert metrics.compute("train") == pytest.approx({"train/loss": 14 / 5})


def test_regression_of_several_values_is_the_mean_over_every_value() -> None:
    metrics = TaskMetrics("regression")
    outputs = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    targets = torch.tensor([[1.0, 0.0], [0.0, 4.0]])  # errors 0, 2, 3, 0
    metrics.update(outputs, targets, torch.tensor(13 / 4), 2)
    assert metrics.compute("val") == pytest.approx(
        {"val/loss": 13 / 4, "val/mse": 13 / 4, "val/mae": 5 / 4}
    )


@pytest.mark.parametrize("hold", HOLDS)
def test_regression_shapes_that_do_not_align_are_an_error(hold, monkeypatch) -> None:
    batches = [(torch.randn(4, 3), torch.randn(4), torch.tensor(1.0), 4)]
    with pytest.raises(DataError) as info:
        _metrics(batches, monkeypatch, hold, "regression").compute("val")
    text = str(info.value)
    assert "output has shape [4, 3] and the targets [4]" in text
    assert "broadcast them to [4, 4]" not in text  # [4, 3] and [4] do not broadcast
    assert "make the model output [4] or [4, 1]" in text and "train.task=none" in text


@pytest.mark.parametrize("hold", HOLDS)
def test_a_batch_scored_unlike_the_ones_before_is_an_error(hold, monkeypatch) -> None:
    """Counted in `samples` but not in `correct`, it would dilute the accuracy."""
    batches = [
        (torch.randn(4, 3), torch.tensor([0, 1, 2, 0]), torch.tensor(1.0), 4),
        (torch.randn(4, 3), torch.randn(4, 3), torch.tensor(1.0), 4),  # soft labels
    ]
    with pytest.raises(DataError, match=r"batch 2 of the epoch .* cannot be scored"):
        _metrics(batches, monkeypatch, hold, "classification").compute("val")


def test_a_run_whose_outputs_cannot_be_scored_reports_the_loss_alone() -> None:
    metrics = TaskMetrics("classification")
    for _ in range(3):  # multi-label logits against as many float targets
        metrics.update(torch.randn(4, 3), torch.rand(4, 3), torch.tensor(0.5), 4)
    assert metrics.compute("val") == {"val/loss": 0.5}


def test_task_none_reports_the_loss_alone_whatever_the_shapes() -> None:
    metrics = TaskMetrics("none")
    metrics.update(torch.randn(4, 3), torch.randn(4), torch.tensor(0.5), 4)
    assert metrics.compute("val") == {"val/loss": 0.5}


def _token_batches():
    """Two batches of [N, C=4, T=2] logits with 3 and 1 real tokens.

    Batch 1: all logits 0, so every token's NLL is ln 4. Batch 2: the target's logit is
    ln 3 and the others 0, so p = 3 / 6 and its NLL is ln 2. Token-weighted mean NLL:
    (3 ln 4 + ln 2) / 4 = 7/4 ln 2, so perplexity = 2 ** 1.75.
    """
    loss_fn = torch.nn.CrossEntropyLoss()
    first = (torch.zeros(2, 4, 2), torch.tensor([[0, 1], [2, -100]]))
    logits = torch.zeros(1, 4, 2)
    logits[0, 3, 0] = math.log(3)
    second = (logits, torch.tensor([[3, -100]]))
    batches = []
    for outputs, targets in (first, second):
        loss = loss_fn(outputs, targets)
        batches.append((outputs, targets, loss, targets.shape[0]))
    assert batches[0][2].item() == pytest.approx(math.log(4))
    assert batches[1][2].item() == pytest.approx(math.log(2))
    return batches, loss_fn


@pytest.mark.parametrize("hold", HOLDS)
@pytest.mark.parametrize("prefix", ["train", "val"])
def test_perplexity_is_exp_of_the_token_weighted_cross_entropy(hold, prefix, monkeypatch) -> None:
    batches, loss_fn = _token_batches()
    # Counted by samples (2 and 1): the loss is sample-weighted, perplexity still by token.
    metrics = _metrics(batches, monkeypatch, hold, "classification", loss_fn=loss_fn)
    values = metrics.compute(prefix)
    assert values[f"{prefix}/perplexity"] == pytest.approx(2**1.75)
    assert values[f"{prefix}/loss"] == pytest.approx((2 * math.log(4) + math.log(2)) / 3)
    # Counted by real tokens (3 and 1): the loss is then the same mean, exp(loss) = ppl.
    tokens = [(o, t, loss, int((t != -100).sum())) for o, t, loss, _ in batches]
    metrics = _metrics(
        tokens, monkeypatch, hold, "classification", ignore_index=-100, loss_fn=loss_fn
    )
    values = metrics.compute(prefix)
    assert values[f"{prefix}/perplexity"] == pytest.approx(2**1.75)
    assert math.exp(values[f"{prefix}/loss"]) == pytest.approx(2**1.75)


def test_perplexity_of_flattened_tokens_needs_token_normalization() -> None:
    loss_fn = torch.nn.CrossEntropyLoss()
    outputs, targets = torch.zeros(3, 4), torch.tensor([0, 1, -100])  # [N*T, C] and [N*T]
    loss = loss_fn(outputs, targets)
    by_token = TaskMetrics("classification", ignore_index=-100, loss_fn=loss_fn)
    by_token.update(outputs, targets, loss, 2)
    assert by_token.compute("val")["val/perplexity"] == pytest.approx(4.0)
    # The same 1-D targets normalized by samples look like plain classification.
    plain = TaskMetrics("classification", loss_fn=loss_fn)
    plain.update(outputs, targets, loss, 3)
    assert "val/perplexity" not in plain.compute("val")


@pytest.mark.parametrize(
    "loss_fn",
    [
        torch.nn.CrossEntropyLoss(label_smoothing=0.1),
        torch.nn.CrossEntropyLoss(weight=torch.ones(4)),
        lambda outputs, targets: torch.nn.functional.cross_entropy(outputs, targets),
        None,
    ],
    ids=["label-smoothing", "class-weights", "own-function", "no-loss-known"],
)
def test_no_perplexity_unless_the_loss_is_plain_cross_entropy(loss_fn) -> None:
    batches, _ = _token_batches()
    metrics = TaskMetrics("classification", loss_fn=loss_fn)
    for batch in batches:
        metrics.update(*batch)
    assert set(metrics.compute("val")) == {"val/loss", "val/accuracy"}


def test_distributed_totals_reduce_every_sum_and_flag(monkeypatch) -> None:
    """Two ranks that saw the same batches report what one does: every sum, count and
    flag is in the one all-reduce (faked here as doubling, what two equal ranks give)."""
    batches, loss_fn = _token_batches()
    single = TaskMetrics("classification", loss_fn=loss_fn)
    double = TaskMetrics("classification", loss_fn=loss_fn)
    for batch in batches:
        single.update(*batch)
        double.update(*batch)
    expected = single.compute("val")
    reduced = []
    monkeypatch.setattr(metrics_module, "rank_and_world_size", lambda: (0, 2))
    monkeypatch.setattr(
        metrics_module.dist, "all_reduce", lambda tensor: reduced.append(tensor.mul_(2))
    )
    assert double.compute("val") == pytest.approx(expected)
    assert len(reduced) == 1 and expected["val/accuracy"] == 2 / 4  # 1 right in batch 1
    assert set(expected) == {"val/loss", "val/accuracy", "val/perplexity"}


def test_a_state_saved_before_separate_counts_still_loads() -> None:
    """Mid-epoch checkpoints of earlier versions divided accuracy by the samples."""
    metrics = TaskMetrics("classification")
    metrics.load_state_dict(
        {
            "task": "classification",
            "loss_sum": torch.tensor(8.0),
            "correct": torch.tensor(6),
            "abs_err": torch.tensor(0.0),
            "sq_err": torch.tensor(0.0),
            "samples": 8,
            "has_accuracy": True,
        }
    )
    metrics.update(
        torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 0]), torch.tensor(1.0), 2
    )
    assert metrics.compute("val") == {"val/loss": 1.0, "val/accuracy": 7 / 10}


def test_test_data_gets_the_regression_errors_too() -> None:
    metrics = TaskMetrics("regression")
    metrics.update(torch.tensor([1.0, 3.0]), torch.tensor([0.0, 0.0]), torch.tensor(5.0), 2)
    assert metrics.compute("test") == {"test/loss": 5.0, "test/mse": 5.0, "test/mae": 2.0}
    assert set(metrics.compute("train")) == {"train/loss"}
