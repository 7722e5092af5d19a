"""Every config change on resume is applied, applied with a message, or refused by name."""

from __future__ import annotations

import logging

import pytest
import torch

import stoker
from stoker.checkpoint import find_latest, load_checkpoint
from stoker.config import RunConfig
from stoker.errors import CheckpointError, ConfigError
from stoker.train.resume import resume_mismatches
from stoker.train.resume_changes import POLICY, config_changes, decision

OPTIONS = dict(batch_size=64, progress="quiet", tensorboard=False, seed=1, schedule="constant")


def mlp(hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3)
    )


def _leaves(value: object, path: tuple[str, ...] = ()):
    if isinstance(value, dict) and value:
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    else:
        yield path


def test_every_config_key_has_a_decision() -> None:
    # A setting added later must be decided (and put in the docs table), not left to a default.
    undecided = [
        ".".join(path)
        for path in _leaves(RunConfig().to_dict())
        if not any(path[:end] in POLICY for end in range(len(path), 0, -1))
    ]
    assert undecided == []


def test_changes_that_alter_the_next_steps_are_refused_by_key() -> None:
    saved = RunConfig.model_validate(
        {
            "data": {
                "train": {"name": "shards", "args": {"paths": "a/*.npy", "shuffle_buffer": 64}}
            },
            "loader": {"weights": [1.0, 2.0]},
            "model": {"name": "mlp", "args": {"hidden": [64]}},
            "optim": {"name": "sgd"},
        }
    ).to_dict()
    current = RunConfig.model_validate(
        {
            "data": {
                "train": {"name": "shards", "args": {"paths": "a/*.npy", "shuffle_buffer": 8}}
            },
            "loader": {"weights": [1.0, 3.0]},
            "model": {"name": "mlp", "args": {"hidden": [32]}},
            "optim": {"name": "adamw", "lr": 0.5, "weight_decay": 0.2},
            "train": {"epochs": 40, "log_every_steps": 7},
            "checkpoint": {"keep_last": 5},
            "tracking": {"tensorboard": False},
        }
    ).to_dict()
    refused = "\n".join(resume_mismatches(saved, current))
    for key in ("data.train.args.shuffle_buffer", "loader.weights", "model.args.hidden",
                "optim.name"):  # fmt: skip
        assert f"{key}: " in refused, key
    changes = config_changes(saved, current)
    assert sorted(line.split(":")[0] for line in changes.adjusted) == [
        "optim.lr",
        "optim.weight_decay",
    ]
    applied = " ".join(changes.applied)
    for key in (
        "train.epochs",
        "train.log_every_steps",
        "checkpoint.keep_last",
        "tracking.tensorboard",
    ):
        assert f"{key}: " in applied, key
    assert decision(("loader", "sampler"))[0] == "refused"


def test_a_changed_lr_and_weight_decay_are_applied_with_a_message(
    tmp_path, toy_classification, caplog
) -> None:
    stoker.fit(mlp(), toy_classification, epochs=1, run_dir=tmp_path, lr=0.01, weight_decay=0.0,
               **OPTIONS)  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="stoker"):
        stoker.fit(mlp(), toy_classification, epochs=2, resume=tmp_path, lr=0.002,
                   weight_decay=0.3, **OPTIONS)  # fmt: skip
    bundle = load_checkpoint(find_latest(tmp_path / "checkpoints"))
    (group,) = bundle["optimizer"]["param_groups"]
    assert (group["lr"], group["weight_decay"]) == (0.002, 0.3)
    assert bundle["scheduler"]["base_lrs"] == [0.002]
    assert "optim.lr changed on resume: 0.01 in the checkpoint, 0.002 now" in caplog.text
    assert "optim.weight_decay changed on resume: 0.0 in the checkpoint, 0.3 now" in caplog.text


def test_another_optimizer_or_model_is_a_named_error_not_a_traceback(
    tmp_path, toy_classification
) -> None:
    stoker.fit(mlp(), toy_classification, epochs=1, run_dir=tmp_path, optimizer="sgd", lr=0.01,
               **OPTIONS)  # fmt: skip
    with pytest.raises(ConfigError, match=r"optim.name: 'sgd' in the checkpoint, 'adamw' now"):
        stoker.fit(mlp(), toy_classification, epochs=2, resume=tmp_path, optimizer="adamw",
                   lr=0.01, **OPTIONS)  # fmt: skip
    with pytest.raises(CheckpointError) as info:
        stoker.fit(mlp(), toy_classification, epochs=2, resume=tmp_path, optimizer="adamw",
                   lr=0.01, allow_config_change=True, **OPTIONS)  # fmt: skip
    message = str(info.value)
    assert "not a AdamW's (optim.name: 'sgd' in the checkpoint, 'adamw' now" in message
    assert "momentum" in message and "start a new run" in message
    with pytest.raises(CheckpointError) as info:
        stoker.fit(mlp(hidden=32), toy_classification, epochs=2, resume=tmp_path, optimizer="sgd",
                   lr=0.01, **OPTIONS)  # fmt: skip
    assert "do not fit this model" in str(info.value) and "size mismatch" in str(info.value)
    assert "Error(s) in loading state_dict" not in str(info.value)


def _steplr(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


@pytest.mark.parametrize("schedule", ["warmup_cosine", "user_steplr"])
def test_a_changed_lr_mid_schedule_follows_the_schedule_from_the_new_base(
    tmp_path, toy_classification, schedule
) -> None:
    """4 steps an epoch; resumed after epoch 1 with a new lr, ended after epoch 2 (step 8).

    The fresh optimizer's lr is the schedule's first value (a warmup's 1/warmup of the
    base), not the base: read as the base, the new lr was 3x too small here.
    """
    options = {**OPTIONS, "schedule": _steplr}
    expected = 0.002 * 0.5**4
    if schedule == "warmup_cosine":
        options = {**OPTIONS, "schedule": "cosine", "warmup_steps": 3, "total_steps": 40}
        from stoker.config import ScheduleConfig
        from stoker.train.optim import lr_multiplier

        config = ScheduleConfig(name="cosine", warmup_steps=3, total_steps=40)
        expected = 0.002 * lr_multiplier(config, total_steps=40, base_lr=0.002)(8)
    stoker.fit(mlp(), toy_classification, epochs=1, run_dir=tmp_path, lr=0.01, **options)
    stoker.fit(mlp(), toy_classification, epochs=2, resume=tmp_path, lr=0.002, **options)
    bundle = load_checkpoint(find_latest(tmp_path / "checkpoints"))
    (group,) = bundle["optimizer"]["param_groups"]
    assert bundle["scheduler"]["base_lrs"] == [0.002]
    assert group["initial_lr"] == 0.002
    assert group["lr"] == pytest.approx(expected, rel=1e-6)


def test_the_docs_table_gives_every_key_its_decision() -> None:
    """docs/checkpoints.md's table of config changes on resume says what POLICY does."""
    import re
    from pathlib import Path

    docs = Path(__file__).parents[2] / "docs" / "checkpoints.md"
    documented: dict[str, str] = {}
    for row in docs.read_text().splitlines():
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        if not row.startswith("| `") or len(cells) != 2:
            continue
        said = "adjusted" if "with a message" in cells[1] else cells[1].split()[0]
        for key in re.findall(r"`([^`]+)`", cells[0]):
            documented[key] = said
    wrong = []
    for path in _leaves(RunConfig().to_dict()):
        # The row naming the key itself, else its nearest section's `section.*` row.
        names = [".".join(path)] + [".".join(path[:end]) + ".*" for end in range(len(path), 0, -1)]
        said = next((documented[name] for name in names if name in documented), None)
        if said != decision(path)[0]:
            wrong.append(f"{'.'.join(path)}: docs {said}, POLICY {decision(path)[0]}")
    assert wrong == []


def test_naming_the_sampler_auto_stands_for_is_no_change() -> None:
    """`auto` is random when shuffling, weighted with weights, else sequential: saying so
    builds the same sampler, so the resume is exact and is not refused."""

    def loader(**settings: object) -> dict:
        return RunConfig.model_validate({"loader": settings}).to_dict()

    same = [
        (loader(shuffle=True), loader(shuffle=True, sampler="random")),
        (loader(shuffle=False), loader(shuffle=False, sampler="sequential")),
        (loader(weights=[1.0, 2.0]), loader(weights=[1.0, 2.0], sampler="weighted")),
        (loader(shuffle=True, sampler="random"), loader(shuffle=True)),
    ]
    for saved, current in same:
        assert config_changes(saved, current).refused == [], (saved["loader"], current)
    changed = config_changes(loader(shuffle=True), loader(shuffle=True, sampler="bucket"))
    assert [line.split(" (")[0] for line in changed.refused] == [
        "loader.sampler: 'auto' in the checkpoint, 'bucket' now"
    ]
