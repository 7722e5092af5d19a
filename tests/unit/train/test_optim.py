"""Optimizers and LR schedules against PyTorch's own schedulers."""

from __future__ import annotations

import pytest
import torch

from stoker.config import OptimConfig, ScheduleConfig
from stoker.train.optim import ConstantLR, build_optimizer, build_scheduler


def _optimizer(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_cosine_matches_cosine_annealing_lr_per_epoch() -> None:
    # The seed module's example: lr 1e-2, T_max 10, stepped once per epoch.
    ours = _optimizer(1e-2)
    theirs = _optimizer(1e-2)
    schedule = build_scheduler(ours, ScheduleConfig(name="cosine"), total_steps=10)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=10)
    after_epoch = []
    for _ in range(10):
        ours.step(), theirs.step()
        schedule.step(), reference.step()
        assert schedule.get_last_lr()[0] == pytest.approx(reference.get_last_lr()[0], abs=1e-12)
        after_epoch.append(schedule.get_last_lr()[0])
    assert f"{after_epoch[0]:.5f}" == "0.00976"
    assert f"{after_epoch[5]:.5f}" == "0.00345"
    # PyTorch gives exactly 0 at T_max; the seed's printed 0.00001 is not what it produces.
    assert f"{after_epoch[9]:.5f}" == "0.00000"


def test_cosine_floor_is_min_lr() -> None:
    optimizer = _optimizer(1.0)
    schedule = build_scheduler(optimizer, ScheduleConfig(name="cosine", min_lr=0.1), total_steps=4)
    for _ in range(4):
        optimizer.step()
        schedule.step()
    assert schedule.get_last_lr()[0] == pytest.approx(0.1)


def test_linear_warmup_then_constant() -> None:
    optimizer = _optimizer(1.0)
    schedule = build_scheduler(optimizer, ScheduleConfig(warmup_steps=4), total_steps=10)
    lrs = []
    for _ in range(6):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


def test_step_schedule_decays_every_step_size() -> None:
    optimizer = _optimizer(1.0)
    schedule = build_scheduler(
        optimizer, ScheduleConfig(name="step", step_size=3, gamma=0.5), total_steps=10
    )
    lrs = []
    for _ in range(7):
        lrs.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert lrs == pytest.approx([1, 1, 1, 0.5, 0.5, 0.5, 0.25])


def test_onecycle_matches_pytorch_onecycle() -> None:
    ours, theirs = _optimizer(0.1), _optimizer(0.1)
    schedule = build_scheduler(ours, ScheduleConfig(name="onecycle"), total_steps=20)
    reference = torch.optim.lr_scheduler.OneCycleLR(
        theirs, max_lr=0.1, total_steps=20, cycle_momentum=False
    )
    for _ in range(19):
        assert schedule.get_last_lr()[0] == pytest.approx(reference.get_last_lr()[0], rel=1e-9)
        ours.step(), theirs.step()
        schedule.step(), reference.step()


def test_build_optimizer_kinds() -> None:
    model = torch.nn.Linear(2, 2)
    cpu = torch.device("cpu")
    sgd = build_optimizer(model, OptimConfig(name="sgd", lr=0.5, momentum=0.8), device=cpu)
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["momentum"] == 0.8
    adam = build_optimizer(model, OptimConfig(name="adam"), device=cpu)
    assert type(adam) is torch.optim.Adam and adam.defaults["fused"] is True
    adamw = build_optimizer(model, OptimConfig(name="adamw", weight_decay=0.1), device=cpu)
    assert isinstance(adamw, torch.optim.AdamW) and adamw.defaults["weight_decay"] == 0.1


def test_a_constant_lr_steps_by_counting_and_keeps_lambdalrs_state() -> None:
    optimizer = _optimizer(0.1)
    schedule = build_scheduler(optimizer, ScheduleConfig(name="constant"), total_steps=10)
    assert isinstance(schedule, ConstantLR)
    reference_optimizer = _optimizer(0.1)
    reference = torch.optim.lr_scheduler.LambdaLR(reference_optimizer, lambda step: 1.0)
    for _ in range(3):
        optimizer.step(), reference_optimizer.step()
        schedule.step(), reference.step()
    assert schedule.get_last_lr() == reference.get_last_lr() == [0.1]
    assert optimizer.param_groups[0]["lr"] == 0.1
    ours, theirs = schedule.state_dict(), reference.state_dict()
    assert ours["last_epoch"] == theirs["last_epoch"] == 3
    assert ours["_step_count"] == theirs["_step_count"]
    # Checkpoints load either way (a run resumed across this change).
    fresh = ConstantLR(_optimizer(0.1))
    fresh.load_state_dict(theirs)
    assert fresh.last_epoch == 3
    reference.load_state_dict(ours)
    assert reference.last_epoch == 3
    # A warmup or a decaying schedule needs the real thing.
    warm = build_scheduler(_optimizer(0.1), ScheduleConfig(warmup_steps=2), total_steps=10)
    assert not isinstance(warm, ConstantLR)


def test_a_constant_lr_leaves_optimizer_step_unwrapped_but_keeps_a_wrapper_it_found() -> None:
    optimizer = _optimizer(0.1)
    ConstantLR(optimizer)
    assert "step" not in vars(optimizer)  # the class's own step: no wrapper per call
    assert optimizer.step.__func__ is torch.optim.SGD.step
    # A schedule made first wrapped it; that wrapper stays (it warns for that schedule).
    wrapped = _optimizer(0.1)
    torch.optim.lr_scheduler.StepLR(wrapped, step_size=1)
    ConstantLR(wrapped)
    assert getattr(wrapped.step, "_wrapped_by_lr_sched", False)
