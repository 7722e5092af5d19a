"""Fault injection for numerical faults: NaN/inf in the loss or a gradient under each
``train.on_nonfinite`` policy (halt, skip, rollback), their limits, and fp16 overflow
counting and a collapsing loss scale."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stoker
from bitwise import assert_bitwise_equal
from stoker.data.prefetch import DevicePrefetcher
from stoker.errors import TrainingError
from stoker.observe.system import SystemMonitor
from stoker.observe.timing import PhaseTimer
from stoker.train.grad_health import GradHealth
from stoker.train.grads import GradClipper
from stoker.train.loop import Loop, train_step
from stoker.train.metrics import StepWindow, TaskMetrics
from stoker.train.monitor import Monitor
from stoker.train.numerics import NumericsGuard
from stoker.train.precision import Precision
from stoker.train.state import TrainState
from stoker_cli import run_cli

NAN, INF = float("nan"), float("inf")
# 256 samples / 32 per step: 8 steps an epoch, in order (no shuffle), so a step is a batch.
OPTIONS = dict(batch_size=32, lr=0.01, shuffle=False, progress="quiet", tensorboard=False, seed=0)


class PoisonedLoss:
    """Cross entropy, made NaN on the given calls (1-based; with no accumulation and no
    validation data, call N is step N)."""

    __name__ = "poisoned_cross_entropy"

    def __init__(self, at: set[int] | range) -> None:
        self.at = at
        self.calls = 0

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        loss = F.cross_entropy(outputs, targets)
        return loss * NAN if self.calls in self.at else loss


def poison_gradient(parameter: nn.Parameter, at: set[int] | range, value: float = INF) -> None:
    """Make ``parameter``'s gradient non-finite on the given backward passes (loss stays finite)."""
    calls = [0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return grad * value if calls[0] in at else grad

    parameter.register_hook(hook)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]


# --- halt ----------------------------------------------------------------------------------


def test_halt_is_the_default_and_names_the_step_and_first_bad_parameter(
    tmp_path, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    model = mlp_factory()
    with pytest.raises(TrainingError) as info:
        stoker.fit(model, (x, y), loss=PoisonedLoss({3}), run_dir=tmp_path / "run", **OPTIONS)
    text = str(info.value)
    assert text.startswith("non-finite loss at step 3 (epoch 1): loss=nan")
    assert "first parameter with a non-finite gradient: 0.weight" in text
    assert "fix: lower optim.lr" in text


def test_a_bad_gradient_is_named_before_clipping_smears_it(
    tmp_path, toy_classification, mlp_factory
) -> None:
    """Clipping by a NaN norm would make every gradient NaN: the check comes first."""
    x, y = toy_classification
    model = mlp_factory()
    poison_gradient(model[2].bias, {2}, NAN)
    with pytest.raises(TrainingError) as info:
        stoker.fit(model, (x, y), clip_grad_norm=1.0, run_dir=tmp_path / "run", **OPTIONS)
    text = str(info.value)
    assert text.startswith("non-finite gradient at step 2 (epoch 1): loss=")
    assert "first parameter with a non-finite gradient: 2.bias" in text


# --- skip ----------------------------------------------------------------------------------


def _loop(model: nn.Module, *, precision: str, policy: str, loss_fn, device: str = "cpu") -> Loop:
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    cpu = torch.device(device)
    return Loop(
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
        precision=Precision(precision, cpu),
        clipper=GradClipper(),
        loss_fn=loss_fn,
        loss_name="cross_entropy",
        task="classification",
        train_loader=None,
        val_loader=None,
        device=cpu,
        state=TrainState(),
        sink=_ListSink(),
        progress=_Messages(),
        monitor=Monitor("train/loss", "min"),
        on_epoch_end=lambda loop, record: None,
        timer=PhaseTimer(cpu),
        system=SystemMonitor(cpu),
        health=GradHealth(0, optimizer_kind="adam"),
        prefetcher=DevicePrefetcher(cpu),
        epochs=1,
        numerics=NumericsGuard(policy),  # type: ignore[arg-type]
    )


class _ListSink:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record) -> None:
        self.records.append(dict(record))


class _Messages:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)

    def start_epoch(self, *a, **k): ...
    def advance(self, *a, **k): ...
    def end_epoch(self, *a, **k): ...


@pytest.mark.parametrize(
    ("precision", "device"),
    [
        ("fp32", "cpu"),
        ("bf16", "cpu"),
        ("fp16", "cpu"),
        pytest.param("bf16", "cuda", marks=pytest.mark.cuda),
        pytest.param("fp16", "cuda", marks=pytest.mark.cuda),
    ],
)
def test_a_skipped_step_leaves_parameters_and_optimizer_state_bitwise_unchanged(
    precision, device, toy_classification, mlp_factory
) -> None:
    x, y = (t.to(device) for t in toy_classification)
    model = mlp_factory().to(device)
    loop = _loop(
        model, precision=precision, policy="skip", loss_fn=PoisonedLoss({2}), device=device
    )
    batches = iter([(x[i : i + 32], y[i : i + 32]) for i in range(0, 96, 32)])
    metrics, window = TaskMetrics("classification"), StepWindow.empty(loop.device)
    assert train_step(loop, batches, metrics, window) == 1
    first_loss = metrics.compute("train")["train/loss"]
    params = [p.detach().clone() for p in model.parameters()]
    optimizer_state = copy.deepcopy(loop.optimizer.state_dict())
    scaler_state = copy.deepcopy(loop.precision.state_dict())

    assert train_step(loop, batches, metrics, window) == 1  # the poisoned step
    for before, after in zip(params, model.parameters(), strict=True):
        assert torch.equal(before, after)
    assert_bitwise_equal(optimizer_state, loop.optimizer.state_dict(), "optimizer")
    assert_bitwise_equal(scaler_state, loop.precision.state_dict(), "scaler")
    assert all(p.grad is None for p in model.parameters())
    assert loop.state.step == 2 and loop.numerics.skipped_steps == [2]
    # The skipped step's NaN is not in the epoch's metrics, nor in the window.
    assert metrics.compute("train")["train/loss"] == first_loss
    assert (window.steps, window.losses) == (2, 1)
    assert loop.sink.records == [
        {"epoch": 1, "step": 2, "numerics/skipped": "loss", "numerics/skipped_steps": 1}
    ]
    assert loop.progress.lines[0].startswith("warning: non-finite loss at step 2 (epoch 1)")
    assert "skipped the step (1 of at most 10" in loop.progress.lines[0]

    train_step(loop, batches, metrics, window)  # training goes on
    assert not torch.equal(params[0], model[0].weight)


def test_skip_goes_on_and_records_each_skipped_step(
    tmp_path, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    result = stoker.fit(
        mlp_factory(),
        (x, y),
        epochs=2,
        loss=PoisonedLoss({3, 6, 12}),
        on_nonfinite="skip",
        run_dir=tmp_path / "run",
        **OPTIONS,
    )
    first, second = result.history
    assert (first["numerics/skipped_steps"], second["numerics/skipped_steps"]) == (2, 1)
    assert (first["step"], second["step"]) == (8, 16)  # skipped steps still count
    assert all(math.isfinite(r["train/loss"]) for r in result.history)
    skipped = [r for r in records(result.run_dir) if "numerics/skipped" in r]
    assert [(r["step"], r["numerics/skipped_steps"]) for r in skipped] == [(3, 1), (6, 2), (12, 3)]


def test_skip_limit_stops_the_run_naming_the_limit_and_the_steps(
    tmp_path, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    with pytest.raises(TrainingError) as info:
        stoker.fit(
            mlp_factory(),
            (x, y),
            loss=PoisonedLoss(range(4, 100)),
            on_nonfinite="skip",
            max_skipped_steps=3,
            run_dir=tmp_path / "run",
            **OPTIONS,
        )
    text = str(info.value)
    assert text.startswith("non-finite loss at step 7 (epoch 1)")
    assert "already skipped 3 steps (train.max_skipped_steps=3): steps 4, 5, 6" in text
    assert "raise train.max_skipped_steps" in text


def test_skipped_steps_count_across_a_resume(tmp_path, toy_classification, mlp_factory) -> None:
    """A resumed run does not get a fresh allowance: the checkpoint carries the count."""
    x, y = toy_classification
    run_dir = tmp_path / "run"
    options = dict(OPTIONS, on_nonfinite="skip", max_skipped_steps=3, run_dir=run_dir)
    first = stoker.fit(mlp_factory(), (x, y), epochs=1, loss=PoisonedLoss({3, 6}), **options)
    assert first.history[-1]["numerics/skipped_steps"] == 2
    with pytest.raises(TrainingError) as info:
        # Steps 9 and 10 are the resumed process's calls 1 and 2.
        stoker.fit(
            mlp_factory(), (x, y), epochs=2, loss=PoisonedLoss({1, 2}), resume=run_dir, **options
        )
    assert "already skipped 3 steps (train.max_skipped_steps=3): steps 3, 6, 9" in str(info.value)


# --- rollback ------------------------------------------------------------------------------


def test_rollback_restores_the_checkpoint_and_goes_on_after_the_bad_batch(
    tmp_path, toy_classification, mlp_factory
) -> None:
    """Checkpoints after steps 2 and 4; step 6 fails: back to step 4, on with batch 7. The
    result is bitwise a run that never saw batches 5 and 6."""
    x, y = toy_classification
    rolled = stoker.fit(
        mlp_factory(),
        (x, y),
        epochs=1,
        loss=PoisonedLoss({6}),
        on_nonfinite="rollback",
        every_steps=2,
        run_dir=tmp_path / "rolled",
        **OPTIONS,
    )
    keep = torch.cat([torch.arange(0, 128), torch.arange(192, 256)])  # without batches 5, 6
    reference = stoker.fit(
        mlp_factory(), (x[keep], y[keep]), epochs=1, run_dir=tmp_path / "ref", **OPTIONS
    )
    for (name, a), b in zip(
        rolled.model.state_dict().items(), reference.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    record = rolled.metrics
    assert (record["step"], record["numerics/rollbacks"]) == (6, 1)
    event = [r for r in records(rolled.run_dir) if "numerics/rolled_back_to_step" in r]
    assert event == [
        {"epoch": 1, "step": 6, "numerics/rolled_back_to_step": 4, "numerics/rollbacks": 1}
    ]
    # The epoch's metrics cover the steps kept: 6 batches of 32.
    assert rolled.metrics["train/loss"] == pytest.approx(reference.metrics["train/loss"])


def test_rollback_limit_stops_the_run(tmp_path, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    with pytest.raises(TrainingError) as info:
        stoker.fit(
            mlp_factory(),
            (x, y),
            loss=PoisonedLoss(range(3, 100)),
            on_nonfinite="rollback",
            max_rollbacks=2,
            every_steps=1,
            run_dir=tmp_path / "run",
            **OPTIONS,
        )
    text = str(info.value)
    # Back to step 2 twice; the third fault (again step 3, counted from the checkpoint) stops.
    assert text.startswith("non-finite loss at step 3 (epoch 1)")
    assert "already rolled back 2 times (train.max_rollbacks=2), at steps 3, 3" in text


def test_rollback_without_a_checkpoint_yet_says_so(
    tmp_path, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    with pytest.raises(TrainingError) as info:
        stoker.fit(
            mlp_factory(),
            (x, y),
            loss=PoisonedLoss({2}),
            on_nonfinite="rollback",
            run_dir=tmp_path / "run",
            **OPTIONS,
        )
    assert "no checkpoint yet to roll back to" in str(info.value)
    assert "checkpoint.every_steps=N" in str(info.value)
    with pytest.raises(TrainingError, match="this run writes no checkpoints"):
        stoker.fit(
            mlp_factory(),
            (x, y),
            loss=PoisonedLoss({2}),
            on_nonfinite="rollback",
            enabled=False,
            run_dir=tmp_path / "off",
            **OPTIONS,
        )


# --- fp16 overflow -------------------------------------------------------------------------


def test_fp16_overflow_steps_are_counted_not_faults(
    tmp_path, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    model = mlp_factory()
    poison_gradient(model[0].weight, {3, 4})  # finite loss, inf gradient: an overflow
    result = stoker.fit(
        model,
        (x, y),
        epochs=2,
        precision="fp16",
        device="cpu",
        run_dir=tmp_path / "run",
        **OPTIONS,
    )
    first, second = result.history
    assert (first["numerics/overflow_steps"], second["numerics/overflow_steps"]) == (2, 0)
    assert first["numerics/loss_scale"] == 2.0**16 / 4  # halved on each overflow
    assert all(math.isfinite(r["train/loss"]) for r in result.history)


def test_a_collapsing_loss_scale_is_an_error(tmp_path, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    model = mlp_factory()
    poison_gradient(model[0].weight, range(2, 1000))
    with pytest.raises(TrainingError) as info:
        stoker.fit(
            model,
            (x, y),
            epochs=5,
            precision="fp16",
            device="cpu",
            run_dir=tmp_path / "run",
            **OPTIONS,
        )
    text = str(info.value)
    assert text.startswith(
        "fp16 loss scale collapsed from 65536 to 0.5 after 17 consecutive overflow steps "
        "(steps 2-18); the model produces inf/NaN gradients even at tiny scales"
    )
    assert "use train.precision=bf16" in text and "train.min_loss_scale=1" in text


def test_an_overflow_burst_after_training_got_going_is_a_warning() -> None:
    guard = NumericsGuard(min_loss_scale=1.0)
    # Before any good step, overflows are the scaler finding its scale: no warning.
    scale = 2.0**16
    for step in range(1, 7):
        assert guard.overflowed(step, scale_before=scale, scale_after=scale / 2) is None
        scale /= 2
    guard.stepped()
    warnings = []
    for step in range(20, 26):
        warnings.append(guard.overflowed(step, scale_before=scale, scale_after=scale / 2))
        scale /= 2
    assert warnings[:4] == [None] * 4 and warnings[5] is None
    assert warnings[4] is not None
    assert warnings[4].startswith("warning: fp16 overflow in 5 steps in a row (steps 20-24)")
    assert guard.epoch_record(loss_scale=scale) == {
        "numerics/overflow_steps": 12,
        "numerics/loss_scale": scale,
    }
    assert guard.epoch_record(loss_scale=scale)["numerics/overflow_steps"] == 0  # reset


# --- the CLI -------------------------------------------------------------------------------

POISON_MODULE = """
import torch
from stoker import ArrayDataset

def dataset(nan_at, **_):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=generator)
    x[nan_at, 0] = float("nan")
    return ArrayDataset(x, (x[:, 0] > 0).long())

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
"""


def _cli_config(tmp_path: Path, *, nan_at: int) -> Path:
    module = tmp_path / "poison.py"
    module.write_text(POISON_MODULE)
    config = tmp_path / "run.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            model: {{name: "{module}:model"}}
            data: {{train: {{name: "{module}:dataset", args: {{nan_at: {nan_at}}}}}}}
            loader: {{batch_size: 32, shuffle: false}}
            train: {{epochs: 1}}
            tracking: {{tensorboard: false}}
            """
        )
    )
    return config


def _stoker(*args: str) -> subprocess.CompletedProcess[str]:
    # The CLI's main in-process (tests/stoker_cli.py): its exit code and stderr are what a
    # fresh process gives; the process path of `stoker train` is tested in tests/integration.
    return run_cli(*args)


def test_cli_halts_with_exit_code_1_and_skips_when_asked(tmp_path) -> None:
    config = _cli_config(tmp_path, nan_at=100)  # sample 100: batch 4
    halted = _stoker("train", str(config), "--run-dir", str(tmp_path / "halt"), "--quiet")
    assert halted.returncode == 1
    assert "stoker: error: non-finite loss at step 4 (epoch 1)" in halted.stderr
    skipped = _stoker(
        "train",
        str(config),
        "train.on_nonfinite=skip",
        "--run-dir",
        str(tmp_path / "skip"),
        "--quiet",
    )
    assert skipped.returncode == 0, skipped.stderr
    epoch = [r for r in records(tmp_path / "skip") if "time/epoch_s" in r]
    assert epoch[0]["numerics/skipped_steps"] == 1 and epoch[0]["step"] == 8
