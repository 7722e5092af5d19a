"""The user's own code in a run: callbacks, optimizer, scheduler, step_fn — and exact resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import stoker
from bitwise import assert_bitwise_equal
from stoker.checkpoint import find_latest, load_checkpoint
from stoker.data.sources import split_train_val_test
from stoker.errors import ConfigError, StokerError
from stoker.train.callbacks import CallbackError, StepRecord

OPTIONS = dict(batch_size=16, progress="quiet", tensorboard=False, seed=3)


class SignMomentum(torch.optim.Optimizer):
    """A Lion-like optimizer that torch.optim does not have: sign of a momentum."""

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                    state["steps"] = torch.zeros(())
                state["momentum"].mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                state["steps"] += 1
                p.add_(state["momentum"].sign(), alpha=-group["lr"])


class HalveEvery(torch.optim.lr_scheduler.LRScheduler):
    """A user schedule: the lr halves every ``every`` steps."""

    def __init__(self, optimizer, every: int = 4) -> None:
        self.every = every
        super().__init__(optimizer)

    def get_lr(self):
        return [base * 0.5 ** (self.last_epoch // self.every) for base in self.base_lrs]


class LossTracker:
    """A stateful callback: counts steps, sums losses, logs a mean; may stop the run."""

    def __init__(self, stop_at: int | None = None, stop_after_epoch: int | None = None) -> None:
        self.stop_at = stop_at
        self.stop_after_epoch = stop_after_epoch
        self.steps = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.events: list[str] = []

    def on_train_start(self, loop) -> None:
        self.events.append("train_start")

    def on_step_end(self, loop, step: StepRecord) -> None:
        assert step.step == loop.state.step and step.loss.ndim == 0
        self.steps += 1
        self.loss_sum += step.loss.double()
        if self.steps % 5 == 0:
            loop.log({"tracker/mean_loss": float(self.loss_sum) / self.steps})
        if self.stop_at is not None and loop.state.step == self.stop_at:
            loop.request_stop(f"LossTracker at step {self.stop_at}")

    def on_validation_end(self, loop, metrics) -> None:
        self.events.append("validation_end")

    def on_epoch_end(self, loop, record) -> None:
        self.events.append("epoch_end")
        record["tracker/steps"] = self.steps  # logged with the epoch's record
        if record["epoch"] == self.stop_after_epoch:
            loop.request_stop(f"LossTracker after epoch {self.stop_after_epoch}")

    def on_checkpoint(self, loop, path) -> None:
        assert (path / "state.pt").is_file()
        self.events.append("checkpoint")

    def on_train_end(self, loop) -> None:
        self.events.append("train_end")

    def state_dict(self) -> dict:
        return {"steps": self.steps, "loss_sum": self.loss_sum.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.loss_sum = state["steps"], state["loss_sum"].clone()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=generator)
    return x, (x[:, 0] + x[:, 1] > 0).long()


def model() -> nn.Module:
    torch.manual_seed(0)
    # Dropout draws from the global RNG: a resume that loses the RNG state differs.
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 2))


def own_fit(run_dir, tracker: LossTracker, **options):
    x, y = data()
    options = {"epochs": 3, **options}
    return stoker.fit(
        model(),
        (x[:80], y[:80]),
        (x[80:], y[80:]),
        optimizer=lambda params: SignMomentum(params, lr=0.01),
        schedule=lambda optimizer: HalveEvery(optimizer, every=4),
        callbacks=[tracker],
        every_steps=2,
        **OPTIONS,
        **options,
        **({} if "resume" in options else {"run_dir": run_dir}),
    )


def final_state(run_dir) -> dict:
    bundle = load_checkpoint(find_latest(run_dir))
    keys = ("model", "optimizer", "scheduler", "train_state", "callbacks", "rng", "history")
    return {key: bundle[key] for key in keys}


@pytest.mark.parametrize(
    ("stop", "steps", "epochs"),
    [({"stop_at": 7}, 7, 1), ({"stop_after_epoch": 2}, 10, 2)],  # 5 steps an epoch
)
def test_stopped_by_a_callback_and_resumed_equals_an_uninterrupted_run(
    tmp_path, stop, steps, epochs
) -> None:
    straight = LossTracker()
    own_fit(tmp_path / "straight", straight)

    first = LossTracker(**stop)
    stopped = own_fit(tmp_path / "run", first)
    assert stopped.stop_reason is not None and stopped.stop_reason.startswith("LossTracker")
    assert first.steps == steps and first.events[-1] == "train_end"
    assert len(stopped.history) == epochs  # an epoch stopped in the middle has no record

    resumed_tracker = LossTracker()
    resumed = own_fit(tmp_path / "run", resumed_tracker, resume=tmp_path / "run")
    assert resumed.stop_reason is None and len(resumed.history) == 3
    assert resumed_tracker.steps == 15  # its state came back from the checkpoint
    for key, state in final_state(tmp_path / "straight").items():
        if key != "history":  # its records hold timings
            assert_bitwise_equal(state, final_state(tmp_path / "run")[key], key)
    assert type(resumed.model) is nn.Sequential


def test_hooks_run_in_order_and_log_to_the_sinks(tmp_path) -> None:
    tracker = LossTracker()
    result = own_fit(tmp_path, tracker, epochs=1)
    assert tracker.events[0] == "train_start" and tracker.events[-1] == "train_end"
    # every 2 steps a checkpoint; then validation, the epoch's record, its checkpoint
    assert tracker.events[1:-1] == ["checkpoint"] * 2 + ["validation_end", "epoch_end"] + [
        "checkpoint"
    ]
    assert result.history[-1]["tracker/steps"] == 5
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    logged = [line for line in lines if "tracker/mean_loss" in line]
    assert [line["step"] for line in logged] == [5]
    assert math.isfinite(logged[0]["tracker/mean_loss"])
    assert any(line.get("tracker/steps") == 5 for line in lines)  # the epoch record


def test_a_callback_that_raises_stops_the_run_naming_it(tmp_path) -> None:
    class Broken:
        def on_step_end(self, loop, step) -> None:
            if step.step == 3:
                raise ValueError("no such key 'acc'")

    x, y = data()
    with pytest.raises(CallbackError) as info:
        stoker.fit(model(), (x, y), epochs=1, callbacks=[Broken()], run_dir=tmp_path, **OPTIONS)
    message = str(info.value)
    assert "Broken.on_step_end raised ValueError: no such key 'acc' at step 3" in message
    assert isinstance(info.value, StokerError) and isinstance(info.value.__cause__, ValueError)


def test_callback_state_that_a_checkpoint_cannot_hold_is_refused_by_name(tmp_path) -> None:
    class Opaque:
        def on_train_start(self, loop) -> None:
            pass

        def state_dict(self) -> dict:
            return {"seen": {1, 2}}

        def load_state_dict(self, state) -> None:
            pass

    x, y = data()
    with pytest.raises(CallbackError, match=r"Opaque\.state_dict\(\)\['seen'\] is a set"):
        stoker.fit(model(), (x, y), epochs=1, callbacks=[Opaque()], run_dir=tmp_path, **OPTIONS)


def test_an_object_with_no_hook_is_refused() -> None:
    x, y = data()
    with pytest.raises(StokerError, match="callback int has none of the hooks"):
        stoker.fit(model(), (x, y), epochs=1, callbacks=[3], **OPTIONS)


def test_an_optimizer_instance_and_a_scheduler_instance_are_used_as_given(tmp_path) -> None:
    net = model()
    optimizer = SignMomentum(net.parameters(), lr=0.02)
    scheduler = HalveEvery(optimizer, every=2)
    x, y = data()
    result = stoker.fit(
        net, (x, y), epochs=1, optimizer=optimizer, schedule=scheduler, run_dir=tmp_path, **OPTIONS
    )
    assert scheduler.last_epoch == 6  # stepped once per optimizer step (96 / 16)
    assert result.metrics["lr"] == pytest.approx(0.02 * 0.5**3)
    assert all(optimizer.state[p]["steps"] == 6 for p in net.parameters())


def test_an_optimizer_over_another_models_parameters_is_refused() -> None:
    x, y = data()
    optimizer = torch.optim.SGD(model().parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="not the model's parameters"):
        stoker.fit(model(), (x, y), epochs=1, optimizer=optimizer, **OPTIONS)


def test_a_scheduler_over_another_optimizer_is_refused() -> None:
    x, y = data()
    other = torch.optim.SGD(model().parameters(), lr=0.1)
    with pytest.raises(ConfigError, match="another optimizer"):
        stoker.fit(
            model(), (x, y), epochs=1, schedule=torch.optim.lr_scheduler.StepLR(other, 2), **OPTIONS
        )


# --- step_fn ---------------------------------------------------------------------------


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 16)
        self.kind = nn.Linear(16, 2)
        self.size = nn.Linear(16, 1)

    def forward(self, x):
        hidden = torch.relu(self.body(x))
        return self.kind(hidden), self.size(hidden).squeeze(1)


def two_head_step(model, batch):
    x, kind, size = batch
    kind_logits, size_pred = model(x)
    kind_loss = nn.functional.cross_entropy(kind_logits, kind)
    size_loss = nn.functional.mse_loss(size_pred, size)
    accuracy = (kind_logits.argmax(1) == kind).float().mean()
    return {"loss": kind_loss + size_loss, "kind_loss": kind_loss, "kind_accuracy": accuracy}


def two_head_data():
    x, kind = data()
    return x, kind, x[:, 2] * 3


def test_step_fn_trains_a_two_headed_model_and_logs_its_other_outputs(tmp_path) -> None:
    x, kind, size = two_head_data()
    seen: list[StepRecord] = []

    class Keep:
        def on_step_end(self, loop, step) -> None:
            seen.append(step)

    result = stoker.fit(
        TwoHeads(),
        (x, kind, size),
        val_fraction=0.25,
        epochs=4,
        lr=0.02,
        step_fn=two_head_step,
        callbacks=[Keep()],
        grad_accum_steps=2,
        run_dir=tmp_path,
        **OPTIONS,
    )
    first, last = result.history[0], result.history[-1]
    for prefix in ("train", "val"):
        assert {f"{prefix}/loss", f"{prefix}/kind_loss", f"{prefix}/kind_accuracy"} <= set(last)
        assert f"{prefix}/accuracy" not in last  # the built-in task metrics are not guessed
    assert last["train/loss"] < first["train/loss"]
    assert last["train/kind_loss"] < last["train/loss"]  # a part of the total
    assert 0.0 <= last["val/kind_accuracy"] <= 1.0
    # a step's record holds its means over both micro-batches
    assert set(seen[0].metrics) == {"train/kind_loss", "train/kind_accuracy"}
    assert seen[0].loss > seen[0].metrics["train/kind_loss"]


def test_eval_fn_replaces_validation_and_a_plain_tensor_is_the_loss(tmp_path) -> None:
    x, kind, size = two_head_data()

    def total(model, batch):
        return two_head_step(model, batch)["loss"]

    def size_error(model, batch):
        x, _, size = batch
        return {"loss": torch.zeros(()), "size_mae": (model(x)[1] - size).abs().mean()}

    result = stoker.fit(
        TwoHeads(), (x, kind, size), val_fraction=0.25, epochs=1, step_fn=total,
        eval_fn=size_error, monitor="val/size_mae", run_dir=tmp_path, **OPTIONS,
    )  # fmt: skip
    assert set(k for k in result.metrics if k.startswith(("train/", "val/"))) == {
        "train/loss",
        "val/loss",
        "val/size_mae",
    }
    assert result.best_value == result.metrics["val/size_mae"]


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ({"total": torch.ones(())}, "returned a dict without 'loss'"),
        (torch.ones(3), "the loss must be a 0-d tensor, got shape [3]"),
        ({"loss": torch.ones((), requires_grad=True), "per": torch.ones(4)}, "'per' has shape"),
        ((1.0, 2.0), "returned a tuple"),
    ],
)
def test_a_step_fn_result_of_the_wrong_shape_is_explained(returned, message) -> None:
    x, kind, size = two_head_data()
    with pytest.raises(StokerError, match="step_fn") as info:
        stoker.fit(TwoHeads(), (x, kind, size), epochs=1, step_fn=lambda m, b: returned, **OPTIONS)
    assert message in str(info.value)


def test_a_step_fn_that_raises_is_named() -> None:
    x, kind, size = two_head_data()

    def broken(model, batch):
        return model(batch["x"])

    with pytest.raises(StokerError, match="step_fn .*broken raised TypeError"):
        stoker.fit(TwoHeads(), (x, kind, size), epochs=1, step_fn=broken, **OPTIONS)


def test_a_step_fn_with_token_normalization_is_refused() -> None:
    x, kind, size = two_head_data()
    with pytest.raises(ConfigError, match="normalize=tokens"):
        stoker.fit(
            TwoHeads(), (x, kind, size), step_fn=two_head_step, normalize="tokens", **OPTIONS
        )


def test_listed_metrics_with_a_step_fn_are_refused_not_dropped() -> None:
    x, kind, size = two_head_data()
    with pytest.raises(ConfigError, match="train.metrics cannot be computed with a step_fn"):
        stoker.fit(TwoHeads(), (x, kind, size), step_fn=two_head_step, metrics=["f1"], **OPTIONS)


def test_the_test_split_of_a_step_fn_run_is_measured_by_its_step_fn(tmp_path) -> None:
    x, kind, size = two_head_data()
    result = stoker.fit(
        TwoHeads(), (x, kind, size), val_fraction=0.25, test_fraction=0.25, epochs=1,
        step_fn=two_head_step, run_dir=tmp_path, **OPTIONS,
    )  # fmt: skip
    assert set(result.test_metrics) == {"test/loss", "test/kind_loss", "test/kind_accuracy"}
    # The test share measured directly with the step function, on the run's weights.
    _, _, test = split_train_val_test(
        stoker.ArrayDataset(x, kind, size), val_fraction=0.25, test_fraction=0.25, seed=0
    )
    with torch.no_grad():
        expected = two_head_step(result.model.eval(), test.arrays)  # type: ignore[attr-defined]
    assert result.test_metrics["test/kind_loss"] == pytest.approx(float(expected["kind_loss"]))


def test_a_step_fn_run_resumed_mid_epoch_reports_the_whole_epochs_outputs(tmp_path) -> None:
    x, kind, size = two_head_data()

    def run(callbacks=(), **options):
        return stoker.fit(
            TwoHeads(), (x, kind, size), epochs=2, step_fn=two_head_step, every_steps=1,
            callbacks=list(callbacks), **OPTIONS, **options,
        )  # fmt: skip

    straight = run(run_dir=tmp_path / "a")
    stopper = LossTracker(stop_at=8)  # epoch 2 (6 steps an epoch), mid-way
    run([stopper], run_dir=tmp_path / "b")
    resumed = run([LossTracker()], resume=tmp_path / "b")
    for key in ("train/loss", "train/kind_loss", "train/kind_accuracy"):
        assert resumed.history[-1][key] == straight.history[-1][key], key
