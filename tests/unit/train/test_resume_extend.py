"""Extending a run with more epochs: exact when the lr schedule does not span the run."""

from __future__ import annotations

import pytest
import torch

import stoker
from stoker.errors import ConfigError
from stoker.train.resume import resume_mismatches, schedule_horizon

OPTIONS = dict(batch_size=32, lr=0.01, progress="quiet", tensorboard=False, seed=1)


def config(schedule: dict, **train: object) -> dict:
    return {"schedule": {"warmup_steps": 0, **schedule}, "train": {"max_steps": None, **train}}


@pytest.mark.parametrize(
    ("schedule", "train", "per_epoch", "horizon"),
    [
        ({"name": "constant", "warmup_steps": 5}, {"epochs": 3}, 10, None),
        ({"name": "step"}, {"epochs": 3}, 10, None),
        ({"name": "cosine", "total_steps": 50}, {"epochs": 3}, 10, None),
        ({"name": "cosine"}, {"epochs": 3}, 10, 30),
        ({"name": "cosine", "warmup_steps": 5}, {"epochs": 3}, 10, 25),
        ({"name": "onecycle"}, {"epochs": 3, "max_steps": 12}, 10, 12),
        ({"name": "cosine"}, {"epochs": 3, "max_steps": 40}, None, 40),  # data without len()
    ],
)
def test_schedule_horizon_is_set_only_by_a_run_length_schedule(
    schedule, train, per_epoch, horizon
) -> None:
    assert schedule_horizon(config(schedule, **train), steps_per_epoch=per_epoch) == horizon


def test_more_epochs_are_a_mismatch_only_when_the_schedule_spans_the_run() -> None:
    fixed = config({"name": "cosine", "total_steps": 100}, epochs=2)
    assert resume_mismatches(fixed, {**fixed, "train": {"epochs": 6}}, steps_per_epoch=23) == []
    spans = config({"name": "cosine", "warmup_steps": 20}, epochs=2)
    longer = {**spans, "train": {"epochs": 6}}
    (line,) = resume_mismatches(spans, longer, steps_per_epoch=23)
    assert "cosine decaying over 26 steps after 20 warmup steps in the checkpoint, 118 now" in line
    assert "schedule.total_steps" in line and "--allow-config-change" in line


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights for every run of a test
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
    )


def test_extending_a_cosine_with_a_fixed_length_equals_the_longer_run(
    tmp_path, toy_classification
) -> None:
    data = toy_classification
    options = dict(OPTIONS, schedule="cosine", total_steps=20)
    straight = stoker.fit(model(), data, epochs=3, run_dir=tmp_path / "a", **options)
    stoker.fit(model(), data, epochs=1, run_dir=tmp_path / "b", **options)
    extended = stoker.fit(model(), data, epochs=3, resume=tmp_path / "b", **options)
    assert len(extended.history) == 3
    for a, b in zip(
        straight.model.state_dict().values(), extended.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)


def test_extending_a_cosine_over_the_whole_run_is_refused_then_allowed(
    tmp_path, toy_classification
) -> None:
    data = toy_classification
    options = dict(OPTIONS, schedule="cosine")
    stoker.fit(model(), data, epochs=1, run_dir=tmp_path, **options)
    with pytest.raises(ConfigError) as info:
        stoker.fit(model(), data, epochs=2, resume=tmp_path, **options)
    assert "cosine decaying over 8 steps in the checkpoint, 16 now" in str(info.value)
    allowed = stoker.fit(
        model(), data, epochs=2, resume=tmp_path, allow_config_change=True, **options
    )
    assert len(allowed.history) == 2
