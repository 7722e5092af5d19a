"""stoker.fit end to end in process: metrics, files, checkpoints, exact resume."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import stoker
import stoker.train.loop as loop_module
from stoker.checkpoint import load_checkpoint
from stoker.errors import CheckpointError, ConfigError

OPTIONS = dict(batch_size=32, lr=0.01, progress="quiet", tensorboard=False)


def test_fit_learns_and_writes_the_run_dir(tmp_path, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    result = stoker.fit(
        mlp_factory(),
        (x[:192], y[:192]),
        (x[192:], y[192:]),
        epochs=8,
        run_dir=tmp_path / "run",
        **{**OPTIONS, "lr": 0.05},
    )
    assert result.run_dir == tmp_path / "run"
    assert len(result.history) == 8
    first, last = result.history[0], result.history[-1]
    assert last["train/loss"] < first["train/loss"]
    assert last["val/accuracy"] > 0.8
    assert result.metrics == last
    assert {
        "epoch",
        "step",
        "train/loss",
        "train/accuracy",
        "val/loss",
        "val/accuracy",
        "lr",
        "grad/norm",
        "time/epoch_s",
        "throughput/samples_per_s",
    } <= set(last)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    epoch_lines = [line for line in lines if "val/loss" in line]
    assert [line["epoch"] for line in epoch_lines] == list(range(1, 9))  # from 1
    assert epoch_lines[-1]["step"] == 8 * 6  # 192 samples / 32 per step
    for name in (
        "config.yaml",
        "model.safetensors",
        "checkpoints/last.json",
        "checkpoints/best.json",
    ):
        assert (tmp_path / "run" / name).is_file(), name
    weights = load_file(tmp_path / "run" / "model.safetensors")
    torch.testing.assert_close(weights["2.weight"], result.model[2].weight.detach())


def test_last_checkpoint_loads_weights_only(tmp_path, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    stoker.fit(mlp_factory(), (x, y), epochs=2, run_dir=tmp_path, **OPTIONS)
    last = json.loads((tmp_path / "checkpoints" / "last.json").read_text())["checkpoint"]
    bundle = torch.load(tmp_path / "checkpoints" / last / "state.pt", weights_only=True)
    assert set(bundle) >= {
        "model",
        "optimizer",
        "scheduler",
        "precision",
        "train_state",
        "rng",
        "config",
    }
    assert bundle["train_state"]["epoch"] == 2
    assert bundle["config"]["train"]["epochs"] == 2


def test_resuming_at_an_epoch_boundary_gives_identical_weights(
    tmp_path, toy_classification, monkeypatch
) -> None:
    x, y = toy_classification
    common = dict(OPTIONS, schedule="cosine", seed=3, val_fraction=None)

    # Dropout makes the RNG matter: a resume that loses the RNG state would differ.
    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
        )

    straight = stoker.fit(model(), (x, y), epochs=4, run_dir=tmp_path / "a", **common)

    # The same run, killed when the third epoch starts (after epoch 2's checkpoint).
    real_train_epoch = loop_module.train_epoch
    calls = []

    def crash_on_third_epoch(loop):
        calls.append(loop.state.epoch)
        if len(calls) == 3:
            raise RuntimeError("killed")
        return real_train_epoch(loop)

    monkeypatch.setattr(loop_module, "train_epoch", crash_on_third_epoch)
    with pytest.raises(RuntimeError, match="killed"):
        stoker.fit(model(), (x, y), epochs=4, run_dir=tmp_path / "b", **common)
    monkeypatch.setattr(loop_module, "train_epoch", real_train_epoch)

    resumed = stoker.fit(model(), (x, y), epochs=4, resume=tmp_path / "b", **common)
    assert resumed.run_dir == tmp_path / "b"
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3, 4]
    for a, b in zip(
        straight.model.state_dict().values(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)
    a = load_checkpoint(tmp_path / "a" / "checkpoints" / "last.json")
    b = load_checkpoint(tmp_path / "b" / "checkpoints" / "last.json")
    assert a["train_state"] == b["train_state"]
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]


def test_gradient_accumulation_option_counts_optimizer_steps(
    tmp_path, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    result = stoker.fit(
        mlp_factory(), (x, y), epochs=1, grad_accum_steps=3, run_dir=tmp_path, **OPTIONS
    )
    assert result.metrics["step"] == 3  # 8 micro-batches -> groups of 3, 3, 2


def test_early_stopping_stops_and_says_so(tmp_path, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    result = stoker.fit(
        mlp_factory(),
        (x, y),
        (x, y),
        epochs=30,
        run_dir=tmp_path,
        early_stopping={"patience": 2, "min_delta": 0.01},
        **{**OPTIONS, "lr": 1e-9},
    )
    assert result.stopped_early
    assert len(result.history) == 3  # best at epoch 1, then two epochs without improvement


def test_regression_reports_mse_and_mae(tmp_path) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(128, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    result = stoker.fit(
        torch.nn.Linear(4, 1), (x, y), (x, y), epochs=3, loss="mse", run_dir=tmp_path, **OPTIONS
    )
    assert {"val/loss", "val/mse", "val/mae"} <= set(result.metrics)
    assert "val/accuracy" not in result.metrics
    assert result.metrics["val/mse"] == pytest.approx(result.metrics["val/loss"], rel=1e-5)


def test_a_callable_loss_is_accepted(tmp_path, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    result = stoker.fit(
        mlp_factory(),
        (x, y),
        (x, y),
        epochs=1,
        run_dir=tmp_path,
        loss=torch.nn.CrossEntropyLoss(label_smoothing=0.1),
        **OPTIONS,
    )
    assert "val/accuracy" in result.metrics  # task inferred from integer labels


def test_a_second_run_in_the_same_dir_is_refused(tmp_path, toy_classification, mlp_factory):
    x, y = toy_classification
    stoker.fit(mlp_factory(), (x, y), epochs=1, run_dir=tmp_path, **OPTIONS)
    with pytest.raises(ConfigError, match="already holds a run"):
        stoker.fit(mlp_factory(), (x, y), epochs=1, run_dir=tmp_path, **OPTIONS)


def test_resume_without_checkpoints_is_an_error(tmp_path, toy_classification, mlp_factory):
    x, y = toy_classification
    with pytest.raises(CheckpointError, match="not a run dir"):
        stoker.fit(mlp_factory(), (x, y), epochs=1, resume=tmp_path, **OPTIONS)


def test_bad_train_data_type_is_explained(mlp_factory) -> None:
    with pytest.raises(ConfigError, match="train_data must be a torch Dataset"):
        stoker.fit(mlp_factory(), [1, 2, 3], **OPTIONS)


def test_compile_trains_like_eager(tmp_path, toy_classification, mlp_factory) -> None:
    x, y = toy_classification
    common = dict(OPTIONS, epochs=2, seed=1)
    eager = stoker.fit(mlp_factory(), (x, y), run_dir=tmp_path / "eager", **common)
    compiled = stoker.fit(
        mlp_factory(), (x, y), run_dir=tmp_path / "compiled", compile=True, **common
    )
    # The result is the plain module (state-dict keys without `_orig_mod.`).
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    assert compiled.metrics["train/loss"] == pytest.approx(eager.metrics["train/loss"], rel=1e-4)


def test_resuming_with_different_data_is_refused_unless_allowed(
    tmp_path, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    stoker.fit(mlp_factory(), (x, y), epochs=1, run_dir=tmp_path, **OPTIONS)
    assert json.loads((tmp_path / "data_fingerprint.json").read_text())["kind"] == "arrays"
    changed = x.clone()
    changed[0, 0] += 1.0
    with pytest.raises(stoker.DataError, match="--allow-data-change"):
        stoker.fit(mlp_factory(), (changed, y), epochs=2, resume=tmp_path, **OPTIONS)
    result = stoker.fit(
        mlp_factory(), (changed, y), epochs=2, resume=tmp_path, allow_data_change=True, **OPTIONS
    )
    assert len(result.history) == 2


def test_run_dir_holds_summary_and_environment(tmp_path, toy_classification, mlp_factory):
    x, y = toy_classification
    result = stoker.fit(mlp_factory(), (x, y), epochs=1, run_dir=tmp_path, **OPTIONS)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verdict"] in {
        "input-bound",
        "partly input-bound",
        "compute-bound",
        "transfer-bound",
    }
    assert set(summary["phases"]) == {
        "data_wait",
        "transfer",
        "forward",
        "backward",
        "optimizer",
        "step",
    }
    assert json.loads((tmp_path / "environment.json").read_text())["torch"] == torch.__version__
    record = result.metrics
    assert record["time/step_s"] > 0 and 0 <= record["time/data_stall_pct"] <= 100
    assert record["system/peak_rss_mib"] > 0 and record["loader/num_workers"] == 0


def test_gradient_health_is_recorded_and_adam_clipping_warned(
    tmp_path, toy_classification, mlp_factory, capsys
) -> None:
    x, y = toy_classification
    stoker.fit(
        mlp_factory(),
        (x, y),
        epochs=3,
        batch_size=16,
        optimizer="adam",
        clip_grad_norm=1e-6,
        grad_health_every=10,
        run_dir=tmp_path,
        tensorboard=False,
        progress="plain",
    )
    out = capsys.readouterr().out
    assert "warning: gradient clipping acted on 100% of the last" in out
    assert "Lower optim.lr instead" in out
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    health = [r for r in records if "grad/layer/0.weight" in r]
    assert [r["step"] for r in health] == [1, 11, 21, 31, 41]  # sampled every 10 steps
    assert all(r["update_ratio/0.weight"] > 0 for r in health)
    epochs = [r for r in records if "grad/clip_rate" in r]
    assert epochs[-1]["grad/clip_rate"] == pytest.approx(1.0)


def test_resuming_with_another_batch_size_names_the_field(
    tmp_path, toy_classification, mlp_factory
) -> None:
    x, y = toy_classification
    stoker.fit(mlp_factory(), (x, y), epochs=1, run_dir=tmp_path, **OPTIONS)
    changed = {**OPTIONS, "batch_size": 64}
    with pytest.raises(ConfigError) as info:
        stoker.fit(mlp_factory(), (x, y), epochs=2, resume=tmp_path, **changed)
    assert "loader.batch_size: 32 in the checkpoint, 64 now" in str(info.value)
    assert "--allow-config-change" in str(info.value)
    result = stoker.fit(
        mlp_factory(), (x, y), epochs=2, resume=tmp_path, allow_config_change=True, **changed
    )
    assert len(result.history) == 2


def test_the_built_in_mlp_takes_one_hidden_width_or_several() -> None:
    from stoker.examples.models import mlp

    widths = [m.out_features for m in mlp(4, 2, hidden=16) if isinstance(m, torch.nn.Linear)]
    assert widths == [16, 2]
    deep = [m.out_features for m in mlp(4, 2, hidden=[8, 6]) if isinstance(m, torch.nn.Linear)]
    assert deep == [8, 6, 2]
