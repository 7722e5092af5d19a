"""A config names the user's optimizer, schedule, callbacks and step by import path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import stoker
from stoker.config import FLAT_OPTIONS, load_config
from stoker.errors import ConfigError
from stoker.train.optim import build_optimizer, build_scheduler
from stoker.train.pipeline import UserComponents

USER_CODE = '''
import torch

class Halving(torch.optim.SGD):
    """An optimizer of the user's own: SGD whose lr halves on each step."""

    def __init__(self, params, lr, momentum=0.0, weight_decay=0.0):
        super().__init__(params, lr=lr, momentum=momentum, weight_decay=weight_decay)

def linear_decay(optimizer, total_steps, floor=0.0):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(floor, 1 - step / total_steps)
    )

class Counter:
    def __init__(self, start=0):
        self.count = start

    def on_step_end(self, loop, step):
        self.count += 1

def step(model, batch):
    x, y = batch
    return {"loss": torch.nn.functional.cross_entropy(model(x), y), "one": torch.ones(())}
'''


def project(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "user.py").write_text(USER_CODE)
    config = folder / "run.yaml"
    config.write_text(body)
    return config


BODY = """
optim: {name: user.py:Halving, lr: 0.1, weight_decay: 0.01, args: {momentum: 0.5}}
schedule: {name: user.py:linear_decay, args: {floor: 0.2}}
callbacks: [user.py:Counter, {name: user.py:Counter, args: {start: 10}}]
train: {step_fn: user.py:step, eval_fn: user.py:step}
"""


def test_import_paths_resolve_from_the_config_folder(tmp_path, monkeypatch) -> None:
    config_path = project(tmp_path / "project", BODY)
    monkeypatch.chdir(tmp_path)  # not the config's folder
    config = load_config("project/run.yaml")
    user = tmp_path / "project" / "user.py"
    assert config.optim.name == f"{user}:Halving"
    assert config.schedule.name == f"{user}:linear_decay"
    assert config.callbacks[0] == f"{user}:Counter"
    assert config.callbacks[1].name == f"{user}:Counter"  # type: ignore[union-attr]
    assert config.callbacks[1].args == {"start": 10}  # type: ignore[union-attr]
    assert config.train.step_fn == config.train.eval_fn == f"{user}:step"
    # An override typed on the command line resolves from the current folder.
    overridden = load_config(config_path, ["callbacks=[elsewhere.py:Counter]"])
    assert overridden.callbacks == [f"{tmp_path / 'elsewhere.py'}:Counter"]


def test_the_configured_optimizer_and_schedule_are_built_with_their_arguments(tmp_path) -> None:
    config = load_config(project(tmp_path, BODY))
    model = torch.nn.Linear(3, 2)
    optimizer = build_optimizer(model, config.optim, device=torch.device("cpu"))
    assert type(optimizer).__name__ == "Halving"
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"]) == (0.1, 0.5, 0.01)
    scheduler = build_scheduler(optimizer, config.schedule, total_steps=4)
    lrs = []
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs == pytest.approx([0.075, 0.05, 0.025, 0.02, 0.02])  # total_steps=4, floor 0.2


def test_a_config_run_trains_with_the_users_parts(tmp_path) -> None:
    config = load_config(
        project(tmp_path, BODY),
        [f"tracking.run_dir={tmp_path / 'run'}", "tracking.tensorboard=false", "train.epochs=3"],
    )
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    user_model = torch.nn.Linear(8, 3)
    result = stoker.train_run(
        config,
        user=UserComponents(
            model=user_model,
            train_data=stoker.ArrayDataset(x, (x[:, 0] > 0).long()),
            val_data=stoker.ArrayDataset(x[:16], (x[:16, 0] > 0).long()),
        ),
        progress="quiet",
    )
    last = result.history[-1]
    assert last["train/one"] == 1.0 and last["val/one"] == 1.0  # the step_fn's extra output
    assert last["step"] == 3  # 64 samples, batch 64: one step an epoch


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.name=adamW", "'adamW' is neither one of adamw, adam, sgd nor an import path"),
        ("schedule.name=linear", "'linear' is neither one of constant, cosine, step, onecycle"),
    ],
)
def test_a_name_that_is_no_builtin_and_no_import_path_is_refused(
    tmp_path, override, message
) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(project(tmp_path, ""), [override])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.name=user.py:Halving", "optim.betas=[0.8,0.9]"], "optim.betas: set for the"),
        (["schedule.name=user.py:linear_decay", "schedule.warmup_steps=5"], "warmup_steps"),
        (["optim.name=user.py:Halving", "optim.args={nesterov_typo: true}"], "optim.args"),
        (["optim.name=user.py:Nope"], "has no attribute 'Nope'"),
    ],
)
def test_settings_the_users_class_would_not_get_are_refused(
    tmp_path, monkeypatch, overrides, message
) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(project(tmp_path, ""), overrides)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ConfigError, match=message):
        optimizer = build_optimizer(model, config.optim, device=torch.device("cpu"))
        build_scheduler(optimizer, config.schedule, total_steps=4)


def test_fit_takes_the_import_path_options_by_their_flat_names() -> None:
    assert FLAT_OPTIONS["optimizer_args"] == ("optim", "args")
    assert FLAT_OPTIONS["schedule_args"] == ("schedule", "args")
    assert FLAT_OPTIONS["loss_args"] == ("loss", "args")
    assert FLAT_OPTIONS["step_fn"] == ("train", "step_fn")
