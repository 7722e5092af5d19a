"""The loop's step: accumulation equivalence, clipping, precision, non-finite halts."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch import nn

from stoker.data.prefetch import DevicePrefetcher
from stoker.errors import DataError, TrainingError
from stoker.observe.system import SystemMonitor
from stoker.observe.timing import PhaseTimer
from stoker.train.grad_health import GradHealth
from stoker.train.grads import FiniteCheck, GradClipper, first_nonfinite_grad
from stoker.train.loop import Loop, _record_window, plain_step, train_step
from stoker.train.metrics import StepWindow, TaskMetrics
from stoker.train.monitor import Monitor
from stoker.train.numerics import NumericsGuard
from stoker.train.precision import Precision
from stoker.train.state import TrainState


class _NullProgress:
    def start_epoch(self, *a, **k): ...
    def advance(self, *a, **k): ...
    def end_epoch(self, *a, **k): ...
    def message(self, *a, **k): ...


class _ListSink:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record) -> None:
        self.records.append(dict(record))


def _loop(
    model: nn.Module,
    *,
    accum: int = 1,
    clipper: GradClipper | None = None,
    loss_fn=None,
    lr: float = 0.1,
) -> Loop:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return Loop(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        precision=Precision("fp32", torch.device("cpu")),
        clipper=clipper or GradClipper(),
        loss_fn=loss_fn or nn.CrossEntropyLoss(),
        loss_name="cross_entropy",
        task="classification",
        train_loader=None,
        val_loader=None,
        device=torch.device("cpu"),
        state=TrainState(),
        sink=_ListSink(),
        progress=_NullProgress(),
        monitor=Monitor("train/loss", "min"),
        on_epoch_end=lambda loop, record: None,
        timer=PhaseTimer(torch.device("cpu")),
        system=SystemMonitor(torch.device("cpu")),
        health=GradHealth(0, optimizer_kind="sgd"),
        prefetcher=DevicePrefetcher(torch.device("cpu")),
        epochs=1,
        grad_accum_steps=accum,
    )


def _batches(x: torch.Tensor, y: torch.Tensor, size: int):
    return iter([(x[i : i + size], y[i : i + size]) for i in range(0, len(x), size)])


def _grads_after_one_step(model: nn.Module, batches, accum: int) -> list[torch.Tensor]:
    loop = _loop(model, accum=accum)
    captured: list[torch.Tensor] = []
    original_step = loop.optimizer_calls.step

    def capture_then_step():
        captured.extend(p.grad.clone() for p in model.parameters())
        original_step()

    loop.optimizer_calls.step = capture_then_step
    train_step(loop, batches, TaskMetrics("classification"), StepWindow.empty(loop.device))
    assert len(captured) == len(list(model.parameters()))  # the step ran, once
    return captured


def test_accumulating_4_x_16_gives_the_gradient_of_1_x_64(toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    x, y = x[:64], y[:64]
    whole = _grads_after_one_step(mlp_factory(), _batches(x, y, 64), accum=1)
    accumulated = _grads_after_one_step(mlp_factory(), _batches(x, y, 16), accum=4)
    for a, b in zip(whole, accumulated, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_smaller_last_micro_batch_is_weighted_by_its_samples(toy_classification, mlp_factory):
    x, y = toy_classification
    x, y = x[:40], y[:40]
    whole = _grads_after_one_step(mlp_factory(), _batches(x, y, 40), accum=1)
    accumulated = _grads_after_one_step(mlp_factory(), _batches(x, y, 16), accum=3)  # 16+16+8
    for a, b in zip(whole, accumulated, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_last_partial_group_still_steps(toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    loop = _loop(mlp_factory(), accum=4)
    batches = _batches(x[:96], y[:96], 16)  # 6 micro-batches: a group of 4, then of 2
    metrics, window = TaskMetrics("classification"), StepWindow.empty(loop.device)
    assert train_step(loop, batches, metrics, window) == 4
    assert train_step(loop, batches, metrics, window) == 2
    assert train_step(loop, batches, metrics, window) == 0
    assert loop.timer.steps == 2
    assert (loop.state.step, loop.state.micro_step, loop.state.samples_seen) == (2, 6, 96)


def test_clip_by_norm_caps_the_norm_and_reports_the_pre_clip_norm() -> None:
    parameter = nn.Parameter(torch.zeros(2))
    parameter.grad = torch.tensor([3.0, 4.0])
    clipper = GradClipper(max_norm=1.0)
    norm = clipper.clip_([parameter])
    assert norm.item() == pytest.approx(5.0)
    assert parameter.grad.norm().item() == pytest.approx(1.0, rel=1e-5)
    assert clipper.clipped_steps.item() == 1


def test_clip_by_value() -> None:
    parameter = nn.Parameter(torch.zeros(3))
    parameter.grad = torch.tensor([3.0, -4.0, 0.1])
    clipper = GradClipper(max_value=0.5)
    norm = clipper.clip_([parameter])
    assert norm.item() == pytest.approx((9 + 16 + 0.01) ** 0.5)
    assert parameter.grad.tolist() == pytest.approx([0.5, -0.5, 0.1])


def test_no_clipping_leaves_gradients_alone() -> None:
    parameter = nn.Parameter(torch.zeros(2))
    parameter.grad = torch.tensor([3.0, 4.0])
    assert GradClipper().clip_([parameter]).item() == pytest.approx(5.0)
    assert parameter.grad.tolist() == [3.0, 4.0]


def test_nan_input_halts_naming_the_step_and_first_bad_parameter(mlp_factory) -> None:
    model = mlp_factory()
    loop = _loop(model)
    x = torch.randn(8, 8)
    x[0, 0] = float("nan")
    batches = iter([(x, torch.zeros(8, dtype=torch.long))])
    with pytest.raises(TrainingError) as info:
        train_step(loop, batches, TaskMetrics("classification"), StepWindow.empty(loop.device))
    text = str(info.value)
    assert "non-finite loss at step 1" in text
    assert "first parameter with a non-finite gradient: 0.weight" in text
    assert first_nonfinite_grad(model) == "0.weight"


def test_output_that_does_not_fit_labels_is_a_clear_error(mlp_factory) -> None:
    loop = _loop(mlp_factory(out_features=3))
    batches = iter([(torch.randn(4, 8), torch.tensor([0, 1, 9, 2]))])
    with pytest.raises(DataError) as info:
        train_step(loop, batches, TaskMetrics("classification"), StepWindow.empty(loop.device))
    assert "labels go up to 9" in str(info.value)
    assert "out_features=10" in str(info.value)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_reduced_precision_steps_on_cpu(name: str, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    model = mlp_factory()
    loop = _loop(model)
    loop.precision = Precision(name, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    train_step(
        loop, _batches(x, y, 64), TaskMetrics("classification"), StepWindow.empty(loop.device)
    )
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert loop.precision.scaling is (name == "fp16")


def test_precision_state_refuses_a_different_mode() -> None:
    state = Precision("fp16", torch.device("cpu")).state_dict()
    with pytest.raises(Exception, match=r"train\.precision=fp16"):
        Precision("fp32", torch.device("cpu")).load_state_dict(state)


def test_token_normalization_matches_one_batch_of_all_real_tokens() -> None:
    """Two micro-batches with different real-token counts: the accumulated gradient is the
    gradient of the mean over every real token of the step, not the mean of two means."""

    class PerToken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.body = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 5))

        def forward(self, ids):
            return self.body(ids).transpose(1, 2)  # [B, C, T] for CrossEntropyLoss

    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 10, (4, 6), generator=generator)
    targets = torch.randint(0, 5, (4, 6), generator=generator)
    targets[0, 2:] = -100  # sample 0: 2 real tokens; sample 1: 6; samples 2-3: 1 each
    targets[2, 1:] = -100
    targets[3, 1:] = -100

    def grads(batches, accum):
        model = PerToken()
        loop = _loop(model, accum=accum)
        loop.normalize = "tokens"
        captured = []
        real_step = loop.optimizer_calls.step

        def capture():
            captured.extend(p.grad.clone() for p in model.parameters())
            real_step()

        loop.optimizer_calls.step = capture
        metrics = TaskMetrics("classification", ignore_index=-100)
        train_step(loop, iter(batches), metrics, StepWindow.empty(loop.device))
        assert len(captured) == len(list(model.parameters()))  # the step ran, once
        return captured

    whole = grads([(ids, targets)], accum=1)
    split = grads([(ids[:2], targets[:2]), (ids[2:], targets[2:])], accum=2)  # 8 vs 2 tokens
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _CountingContext:
    """Stands in for DDP's ``model.no_sync``: counts how often a micro-batch ran inside."""

    def __init__(self) -> None:
        self.entered = 0
        self.active = False

    def __call__(self):
        return self

    def __enter__(self):
        self.entered += 1
        self.active = True
        return self

    def __exit__(self, *exc) -> None:
        self.active = False


def test_no_sync_wraps_every_micro_batch_but_the_last_of_a_step(
    toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    model = mlp_factory()
    loop = _loop(model, accum=4)
    no_sync = _CountingContext()
    loop.no_sync = no_sync
    backward_inside: list[bool] = []
    model[0].weight.register_hook(lambda grad: backward_inside.append(no_sync.active))
    batches = _batches(x[:96], y[:96], 16)  # a group of 4, then a group of 2
    metrics, window = TaskMetrics("classification"), StepWindow.empty(loop.device)
    train_step(loop, batches, metrics, window)
    assert no_sync.entered == 3
    assert backward_inside == [True, True, True, False]  # the last backward all-reduces
    train_step(loop, batches, metrics, window)
    assert no_sync.entered == 4
    assert backward_inside[4:] == [True, False]
    # Without accumulation the context is never entered.
    single = _loop(mlp_factory(), accum=1)
    single.no_sync = _CountingContext()
    train_step(single, _batches(x, y, 16), metrics, StepWindow.empty(single.device))
    assert single.no_sync.entered == 0


def test_measuring_then_clipping_is_bitwise_clip_grad_norm(mlp_factory) -> None:
    def grads(model):
        torch.manual_seed(1)
        model(torch.randn(16, 8) * 50).pow(2).sum().backward()
        return model

    ours, theirs = grads(mlp_factory()), grads(mlp_factory())
    clipper = GradClipper(max_norm=0.5)
    params = list(ours.parameters())
    norm = clipper.measure([p.grad for p in params], wanted=False)
    clipper.apply_(params, norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.5, foreach=True)
    assert torch.equal(norm, expected)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
    assert clipper.clipped_steps.item() == 1
    # Not clipping by norm, the norm is measured only when asked for.
    assert GradClipper().measure([p.grad for p in params], wanted=False) is None
    assert GradClipper(max_value=1.0).measure([p.grad for p in params], wanted=False) is None


def _norms_before_each_step(loop, model) -> list[torch.Tensor]:
    """The gradients' total norm as each optimizer step starts, appended as it runs."""
    norms: list[torch.Tensor] = []
    real_step = loop.optimizer_calls.step

    def note_norm():
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
        real_step()

    loop.optimizer_calls.step = note_norm
    return norms


@pytest.mark.parametrize(("clip", "norms"), [(None, 1), (1e6, 3)])
def test_the_grad_norm_is_measured_on_a_windows_first_step_unless_clipping_needs_it(
    clip, norms, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    model = mlp_factory()
    loop = _loop(model, clipper=GradClipper(max_norm=clip))
    batches = _batches(x[:96], y[:96], 32)
    metrics, window = TaskMetrics("classification"), StepWindow.empty(loop.device)
    expected = _norms_before_each_step(loop, model)
    for _ in range(3):
        train_step(loop, batches, metrics, window)
    assert (window.steps, window.losses, window.norms) == (3, 3, norms)
    torch.testing.assert_close(window.grad_norm, sum(expected[:norms]))


# --- what a step records without extra work -------------------------------------------


def test_the_check_keeps_the_loss_and_the_norm_it_read() -> None:
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    loss = nn.functional.cross_entropy(
        model(torch.randn(8, 6)), torch.tensor([0, 1, 2] * 2 + [0, 1])
    )
    loss.backward()
    check = FiniteCheck(list(model.parameters()))
    assert check(loss) == (True, True)
    assert check.loss_value == loss.item()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert check.grad_norm == pytest.approx(expected.item(), rel=1e-6)
    # A non-finite gradient: no norm to record.
    next(model.parameters()).grad[0, 0] = math.inf
    assert check(loss) == (True, False)
    assert check.grad_norm is None


def test_a_recorded_step_measures_no_norm_of_its_own(
    toy_classification, mlp_factory, monkeypatch
) -> None:
    """Not clipping, the window's norm is the check's: no second pass over the gradients."""
    x, y = toy_classification
    model = mlp_factory()
    loop = _loop(model)
    expected = _norms_before_each_step(loop, model)
    measured = []
    monkeypatch.setattr(GradClipper, "measure", lambda *a, **k: measured.append(1))
    metrics, window = TaskMetrics("classification"), StepWindow.empty(loop.device)
    batches = _batches(x[:96], y[:96], 32)
    losses = []
    for _ in range(3):
        train_step(loop, batches, metrics, window)
        losses.append(loop.step_loss.item())
    assert measured == []
    assert window.norms == 1
    torch.testing.assert_close(window.grad_norm, expected[0])
    assert (window.losses, window.loss_sum) == (3, pytest.approx(math.fsum(losses)))
    _record_window(loop, window)
    assert loop.sink.records[-1]["train/loss"] == pytest.approx(math.fsum(losses) / 3)
    assert loop.sink.records[-1]["grad/norm"] == pytest.approx(expected[0].item(), rel=1e-6)


def test_clipping_by_norm_still_measures_as_clip_grad_norm(toy_classification, mlp_factory):
    x, y = toy_classification
    loop = _loop(mlp_factory(), clipper=GradClipper(max_norm=1e6))
    metrics, window = TaskMetrics("classification"), StepWindow.empty(loop.device)
    calls = []
    measure = GradClipper.measure

    def counted(self, grads, *, wanted):
        calls.append(wanted)
        return measure(self, grads, wanted=wanted)

    loop.clipper.measure = counted.__get__(loop.clipper)
    train_step(loop, _batches(x[:64], y[:64], 32), metrics, window)
    train_step(loop, _batches(x[64:128], y[64:128], 32), metrics, window)
    assert calls == [True, False]  # every step: the clipped gradients are clip_grad_norm_'s


def _accumulators(loss: torch.Tensor) -> list:
    """The gradient accumulator nodes a loss's graph ends in (one per parameter)."""
    found, stack = [], [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None:
            continue
        if type(node).__name__ == "AccumulateGrad":
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


@pytest.mark.parametrize("accum", [1, 2])
def test_a_step_reuses_the_gradient_accumulators_of_the_step_before(
    accum, toy_classification, mlp_factory
) -> None:
    # The last step's graph is kept until the next step has run, as a hand loop's `loss`
    # variable is: the next forward finds the parameters' accumulators still alive.
    x, y = toy_classification
    model = mlp_factory()
    loop = _loop(model, accum=accum)
    batches = _batches(x[:128], y[:128], 16)
    metrics, window = TaskMetrics("classification"), StepWindow.empty(loop.device)
    train_step(loop, batches, metrics, window)
    assert loop.kept_graph is not None and loop.kept_graph.grad_fn is not None
    first = _accumulators(loop.kept_graph)
    assert len(first) == len(list(model.parameters()))
    for node in first:
        node.metadata["first step"] = True  # on the C++ node: seen again only if reused
    del first  # the loop's reference alone keeps them now
    train_step(loop, batches, metrics, window)
    again = _accumulators(loop.kept_graph)
    assert len(again) == len(list(model.parameters()))
    assert all(node.metadata.get("first step") for node in again)
    # What the metrics hold and the step records carry no graph.
    assert loop.step_loss is not None and loop.step_loss.grad_fn is None
    assert not loop.step_loss.requires_grad


# --- the plain step: the common run, from locals --------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"grad_accum_steps": 2},
        {"precision": Precision("bf16", torch.device("cpu"))},
        {"clipper": GradClipper(max_norm=1.0)},
        {"normalize": "tokens"},
        {"step_fn": lambda model, batch: model(batch[0]).sum()},
    ],
    ids=["accumulating", "bf16", "clipping", "tokens", "step_fn"],
)
def test_the_plain_step_serves_the_common_run_only(change, mlp_factory) -> None:
    loop = _loop(mlp_factory())
    metrics = TaskMetrics("classification")
    assert plain_step(loop, metrics) is not None  # fp32, one micro-batch, no clipping
    for name, value in change.items():
        setattr(loop, name, value)
    assert plain_step(loop, metrics) is None  # train_step makes every step


def _steps_taken(loop: Loop, metrics: TaskMetrics, *, plain: bool):
    """``step(batches, window)`` of the plain step or of train_step."""
    if plain:
        step = plain_step(loop, metrics)
        assert step is not None
        return step
    return lambda batches, window: train_step(loop, batches, metrics, window)


def _train(model, x, y, *, plain: bool, policy: str = "halt") -> tuple[Loop, TaskMetrics, list]:
    """Ten steps of 16, in windows of four, the gradients sampled every third step."""
    loop = _loop(model)
    loop.health = GradHealth(3, optimizer_kind="sgd")
    loop.numerics = NumericsGuard(policy)
    metrics = TaskMetrics("classification")
    step = _steps_taken(loop, metrics, plain=plain)
    batches, windows, window = _batches(x[:160], y[:160], 16), [], StepWindow.empty(loop.device)
    while step(batches, window):
        if window.steps == 4:
            windows.append(window)
            window = StepWindow.empty(loop.device)
    windows.append(window)
    return loop, metrics, windows


@pytest.mark.parametrize("policy", ["halt", "skip"])
def test_the_plain_step_trains_and_records_as_train_step_does(
    policy, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    x = x.clone()
    if policy == "skip":
        x[70, 0] = math.nan  # the fifth batch: a step that is skipped and counted
    runs = {plain: _train(mlp_factory(), x, y, plain=plain, policy=policy) for plain in (1, 0)}
    (fast, fast_metrics, fast_windows), (slow, slow_metrics, slow_windows) = runs[1], runs[0]
    for a, b in zip(fast.model.parameters(), slow.model.parameters(), strict=True):
        assert torch.equal(a, b)  # bitwise: the same calls in the same order
    state_of = lambda loop: (loop.state.step, loop.state.micro_step, loop.state.samples_seen)  # noqa: E731
    assert state_of(fast) == state_of(slow) == (10, 10, 160)
    assert fast_metrics.compute("train") == slow_metrics.compute("train")
    assert fast.timer.steps == slow.timer.steps == 10
    assert fast.numerics.skipped_steps == slow.numerics.skipped_steps
    assert len(fast.numerics.skipped_steps) == (policy == "skip")
    # The health sampled steps 0, 3, 6 and 9, through _update, into the same records.
    health = [r for r in fast.sink.records if any(k.startswith("grad/layer/") for k in r)]
    assert [r["step"] for r in health] == [1, 4, 7, 10]
    assert fast.sink.records == slow.sink.records
    counts = [(w.steps, w.losses, w.norms, w.samples) for w in fast_windows]
    assert counts == [(w.steps, w.losses, w.norms, w.samples) for w in slow_windows]
    assert counts[0] == (4, 4, 1, 64) and counts[-1] == (2, 2, 1, 32)
    for a, b in zip(fast_windows, slow_windows, strict=True):
        assert a.loss_sum == b.loss_sum
        assert torch.equal(a.grad_norm, b.grad_norm)


def test_a_non_finite_loss_halts_the_plain_step_naming_the_step(mlp_factory) -> None:
    loop = _loop(mlp_factory())
    step = _steps_taken(loop, TaskMetrics("classification"), plain=True)
    x = torch.randn(8, 8)
    x[0, 0] = float("nan")
    batches = iter(
        [(torch.randn(8, 8), torch.zeros(8, dtype=torch.long))] * 2
        + [(x, torch.zeros(8, dtype=torch.long))]
    )
    window = StepWindow.empty(loop.device)
    assert step(batches, window) == step(batches, window) == 1
    with pytest.raises(TrainingError, match="non-finite loss at step 3"):
        step(batches, window)
    assert loop.state.step == 2  # nothing was updated


@pytest.mark.parametrize("plain", [True, False])
def test_the_step_befores_graph_is_let_go_before_backward(plain, toy_classification, mlp_factory):
    # As a hand loop's `loss = loss_fn(...)` does: backward can then reuse its memory.
    x, y = toy_classification
    model = mlp_factory()
    loop = _loop(model)
    step = _steps_taken(loop, TaskMetrics("classification"), plain=plain)
    batches, window = _batches(x[:64], y[:64], 32), StepWindow.empty(loop.device)
    step(batches, window)
    before = weakref.ref(loop.kept_graph)
    alive_in_backward = []
    next(model.parameters()).register_hook(lambda grad: alive_in_backward.append(before()))
    step(batches, window)
    assert alive_in_backward == [None]  # gone by the time backward ran
    assert loop.kept_graph is not None and loop.kept_graph.grad_fn is not None
