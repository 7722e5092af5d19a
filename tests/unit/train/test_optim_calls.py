"""OptimizerCalls: the direct fused step is bitwise optimizer.step(), or it is not taken."""

from __future__ import annotations

import copy
import sys
import types

import pytest
import torch
from torch import nn

from stoker.train import optim_calls
from stoker.train.optim_calls import OptimizerCalls
from stoker.train.precision import Precision

CPU = torch.device("cpu")
FP32 = Precision("fp32", CPU)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 6, generator=generator), torch.randint(0, 3, (16,), generator=generator)


def _train(model: nn.Module, step, zero_grad, steps: int = 12, *, before=None) -> None:
    for index in range(steps):
        if before is not None:
            before(index)
        x, y = _batch(index)
        nn.functional.cross_entropy(model(x), y).backward()
        step()
        zero_grad()


def _assert_same(a: torch.optim.Optimizer, b: torch.optim.Optimizer, ma, mb) -> None:
    for p, q in zip(ma.parameters(), mb.parameters(), strict=True):
        assert torch.equal(p, q)
        assert p.grad is None and q.grad is None
        state_a, state_b = a.state[p], b.state[q]
        assert state_a.keys() == state_b.keys()
        for key in state_a:
            assert torch.equal(state_a[key], state_b[key]), key


OPTIMIZERS = [
    pytest.param(torch.optim.Adam, {}, id="adam"),
    pytest.param(torch.optim.AdamW, {"weight_decay": 0.05}, id="adamw"),
    pytest.param(torch.optim.Adam, {"weight_decay": 0.1, "amsgrad": True}, id="adam-amsgrad"),
    pytest.param(torch.optim.Adam, {"maximize": True, "betas": (0.8, 0.9)}, id="adam-maximize"),
    pytest.param(
        torch.optim.Adam, {"weight_decay": 0.1, "decoupled_weight_decay": True}, id="adam-decoupled"
    ),
]


@pytest.mark.parametrize(("cls", "options"), OPTIMIZERS)
def test_the_direct_step_is_bitwise_optimizer_step(cls, options) -> None:
    plain_model, direct_model = _model(), _model()
    plain = cls(plain_model.parameters(), lr=0.01, fused=True, **options)
    direct = cls(direct_model.parameters(), lr=0.01, fused=True, **options)
    calls = OptimizerCalls(direct, FP32)
    _train(plain_model, plain.step, lambda: plain.zero_grad(set_to_none=True))
    _train(direct_model, calls.step, calls.zero_grad)
    _assert_same(plain, direct, plain_model, direct_model)
    assert calls.direct_steps == 11  # all but the first, which makes the state


def test_lr_changes_and_several_groups_are_followed() -> None:
    def groups(model: nn.Module) -> list[dict]:
        first, second = model[0], model[2]
        return [
            {"params": first.parameters(), "weight_decay": 0.1},
            {"params": second.parameters(), "lr": 0.05},
        ]

    plain_model, direct_model = _model(), _model()
    plain = torch.optim.AdamW(groups(plain_model), lr=0.01, fused=True)
    direct = torch.optim.AdamW(groups(direct_model), lr=0.01, fused=True)
    schedules = [
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)) for opt in (plain, direct)
    ]
    calls = OptimizerCalls(direct, FP32)

    def plain_step() -> None:
        plain.step()
        schedules[0].step()

    def direct_step() -> None:
        calls.step()
        schedules[1].step()

    _train(plain_model, plain_step, plain.zero_grad)
    _train(direct_model, direct_step, calls.zero_grad)
    _assert_same(plain, direct, plain_model, direct_model)
    assert calls.direct_steps == 11
    assert direct.param_groups[1]["lr"] == plain.param_groups[1]["lr"] < 0.05


def test_a_loaded_state_is_followed() -> None:
    model, twin = _model(), _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(optimizer, FP32)
    _train(model, calls.step, calls.zero_grad, steps=3)
    # state_dict() holds the live tensors: copies are what a checkpoint would hold.
    saved_model, saved_optimizer = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    _train(model, calls.step, calls.zero_grad, steps=3)  # moves on from the saved point

    model.load_state_dict(saved_model)
    # New state tensors (load_state_dict keeps the ones it is given: each load gets a copy).
    optimizer.load_state_dict(copy.deepcopy(saved_optimizer))
    _train(model, calls.step, calls.zero_grad, steps=4)

    twin.load_state_dict(saved_model)
    reference = torch.optim.Adam(twin.parameters(), lr=0.01, fused=True)
    reference.load_state_dict(copy.deepcopy(saved_optimizer))
    _train(twin, reference.step, reference.zero_grad, steps=4)
    _assert_same(reference, optimizer, twin, model)
    assert calls.direct_steps == 2 + 3 + 4  # the loaded state is read from the next step


def test_a_parameter_without_a_gradient_is_left_alone_as_adam_does() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(optimizer, FP32)
    _train(model, calls.step, calls.zero_grad, steps=2)
    frozen = model[2].bias
    before, steps_before = frozen.detach().clone(), optimizer.state[frozen]["step"].clone()
    x, y = _batch(9)
    nn.functional.cross_entropy(model(x), y).backward()
    frozen.grad = None
    calls.step()
    assert torch.equal(frozen, before)
    assert torch.equal(optimizer.state[frozen]["step"], steps_before)
    assert calls.direct_steps == 2  # every step but the first


def test_hooks_the_profiler_and_foreign_wrappers_get_the_real_step() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(optimizer, FP32)
    seen: list[str] = []
    _train(model, calls.step, calls.zero_grad, steps=2)
    assert calls.direct_steps == 1

    handle = optimizer.register_step_post_hook(lambda *args: seen.append("hook"))
    _train(model, calls.step, calls.zero_grad, steps=2)
    handle.remove()
    assert seen == ["hook", "hook"] and calls.direct_steps == 1

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        _train(model, calls.step, calls.zero_grad, steps=1)
    names = {event.name for event in profile.events()}
    assert "Optimizer.step#Adam.step" in names and calls.direct_steps == 1
    assert any(name.startswith("Optimizer.zero_grad#") for name in names)

    real = optimizer.step

    def wrapped(*args, **kwargs):
        seen.append("wrapper")
        return real(*args, **kwargs)

    optimizer.step = wrapped  # type: ignore[method-assign]
    _train(model, calls.step, calls.zero_grad, steps=2)
    assert seen.count("wrapper") == 2 and calls.direct_steps == 1


def test_a_schedulers_counting_wrapper_keeps_the_direct_path() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(optimizer, FP32)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)  # wraps optimizer.step, after
    _train(model, calls.step, calls.zero_grad, steps=4)
    assert calls.direct_steps == 3  # all but the first, which makes the state


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: torch.optim.Adam(p, lr=0.01), id="adam-unfused"),
        pytest.param(lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), id="sgd"),
        pytest.param(
            lambda p: torch.optim.Adam(p, lr=torch.tensor(0.01), fused=True), id="tensor-lr"
        ),
    ],
)
def test_other_optimizers_take_their_own_step(make) -> None:
    plain_model, other_model = _model(), _model()
    plain, other = make(plain_model.parameters()), make(other_model.parameters())
    calls = OptimizerCalls(other, FP32)
    _train(plain_model, plain.step, plain.zero_grad)
    _train(other_model, calls.step, calls.zero_grad)
    _assert_same(plain, other, plain_model, other_model)
    assert calls.direct_steps == 0


def test_fp16_steps_through_the_scaler() -> None:
    precision = Precision("fp16", CPU)
    optimizer = torch.optim.Adam(_model().parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(optimizer, precision)
    assert calls.step.func == precision.step and calls.step.args == (optimizer,)


@pytest.mark.cuda
def test_the_direct_step_is_bitwise_optimizer_step_on_cuda() -> None:
    cuda = torch.device("cuda")
    plain_model, direct_model = _model().to(cuda), _model().to(cuda)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=0.01, fused=True)
    direct = torch.optim.AdamW(direct_model.parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(direct, Precision("fp32", cuda))

    def on_cuda(model: nn.Module, step, zero_grad) -> None:
        for index in range(6):
            x, y = _batch(index)
            nn.functional.cross_entropy(model(x.to(cuda)), y.to(cuda)).backward()
            step()
            zero_grad()

    on_cuda(plain_model, plain.step, plain.zero_grad)
    on_cuda(direct_model, calls.step, calls.zero_grad)
    _assert_same(plain, direct, plain_model, direct_model)
    assert calls.direct_steps == 5


def test_a_kernel_that_refuses_its_arguments_hands_over_to_optimizer_step(monkeypatch) -> None:
    """Another PyTorch's signature: the direct path gives up, and no step is lost."""
    plain_model, direct_model = _model(), _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01, fused=True)
    direct = torch.optim.Adam(direct_model.parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(direct, FP32)

    _train(plain_model, plain.step, plain.zero_grad)
    real, refused = torch._fused_adam_, []

    def refuses_once(*args, **kwargs):  # stoker's first call is refused; torch.optim's run
        if not refused and sys._getframe(1).f_globals["__name__"] == optim_calls.__name__:
            refused.append(True)
            raise TypeError("_fused_adam_() got an unexpected keyword argument 'grad_scale'")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_adam_", refuses_once)
    _train(direct_model, lambda: calls.step(), calls.zero_grad)  # looked up each step
    _assert_same(plain, direct, plain_model, direct_model)
    assert refused and calls.direct_steps == 0
    assert calls.step.func is not None and calls.step.args == (direct,)  # optimizer.step() now


def _replace_group(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    optimizer.param_groups[0] = {**optimizer.param_groups[0], "lr": 0.1}


def _wrap_then_schedule(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """A user's wrapper of step (a projection after each step), then a scheduler, which
    wraps that wrapper and marks it as its own counter."""
    class_step = type(optimizer).step

    def constrained(self, *args, **kwargs):
        out = class_step(self, *args, **kwargs)
        with torch.no_grad():
            for parameter in self.param_groups[0]["params"]:
                parameter.clamp_(-0.05, 0.05)
        return out

    optimizer.step = types.MethodType(constrained, optimizer)  # type: ignore[method-assign]
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _load_adamw_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """An Adam given an AdamW checkpoint: its groups now decouple the weight decay."""
    donor = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=True)
    x, y = _batch(99)
    nn.functional.cross_entropy(model(x), y).backward()
    donor.step()
    donor.zero_grad()
    optimizer.load_state_dict(copy.deepcopy(donor.state_dict()))


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda opt, model: opt.state.clear(), id="state-cleared"),
        pytest.param(lambda opt, model: opt.state.__setitem__(model[0].weight, {}), id="one-reset"),
        pytest.param(_replace_group, id="group-replaced"),
        pytest.param(lambda opt, model: opt.param_groups[0].update(lr=0.2), id="lr-edited"),
        pytest.param(_wrap_then_schedule, id="user-wrapper-under-scheduler"),
        pytest.param(_load_adamw_state, id="adamw-state-loaded"),
    ],
)
def test_changes_made_in_place_between_steps_are_followed(change) -> None:
    """Whatever changes in the optimizer between steps, the next direct step sees it."""
    plain_model, direct_model = _model(), _model()
    plain = torch.optim.Adam(plain_model.parameters(), lr=0.01, fused=True)
    direct = torch.optim.Adam(direct_model.parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(direct, FP32)
    _train(plain_model, plain.step, plain.zero_grad, steps=3)
    _train(direct_model, calls.step, calls.zero_grad, steps=3)
    change(plain, plain_model)
    change(direct, direct_model)
    _train(plain_model, plain.step, plain.zero_grad, steps=4)
    _train(direct_model, calls.step, calls.zero_grad, steps=4)
    _assert_same(plain, direct, plain_model, direct_model)


def test_parameters_added_to_a_group_in_place_are_stepped_and_cleared() -> None:
    """``group["params"].append(p)``: optimizer.step() takes it up; so must the direct
    calls, and zero_grad must clear its gradient too."""
    plain_model, direct_model = _model(), _model()
    plain = torch.optim.Adam(plain_model[0].parameters(), lr=0.01, fused=True)
    direct = torch.optim.Adam(direct_model[0].parameters(), lr=0.01, fused=True)
    calls = OptimizerCalls(direct, FP32)
    _train(plain_model, plain.step, plain.zero_grad, steps=2)
    _train(direct_model, calls.step, calls.zero_grad, steps=2)
    plain.param_groups[0]["params"].extend(plain_model[2].parameters())
    direct.param_groups[0]["params"].extend(direct_model[2].parameters())
    _train(plain_model, plain.step, plain.zero_grad, steps=4)
    _train(direct_model, calls.step, calls.zero_grad, steps=4)
    for p, q in zip(plain_model.parameters(), direct_model.parameters(), strict=True):
        assert torch.equal(p, q) and q.grad is None
    assert calls.direct_steps == 1 + 3  # the step after the extend makes the new state
