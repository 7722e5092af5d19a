"""train.metrics: built-ins against scikit-learn, user functions, torchmetrics objects, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from stoker.config import MetricSpec, RunConfig, validate_config
from stoker.errors import ConfigError, DataError
from stoker.train.metric_set import build_metrics, monitor_mode, split_fit_metrics

sklearn_metrics = pytest.importorskip("sklearn.metrics")

CPU = torch.device("cpu")


def _run(specs, batches, *, user=(), ignore_index=None, prefix="val", reported=None):
    """The metrics of ``batches`` [(outputs, targets)], fed batch by batch."""
    run = build_metrics(specs, user).start(device=CPU, ignore_index=ignore_index)
    for outputs, targets in batches:
        run.update(outputs, targets)
    return run.compute(prefix, reported=reported or {})


def _batches(outputs, targets, sizes=(16, 16, 7)):
    """Uneven batches: a mean of per-batch figures would differ from the whole set's."""
    out, at = [], 0
    for size in sizes:
        out.append((outputs[at : at + size], targets[at : at + size]))
        at += size
    assert at == len(outputs)
    return out


def _classes(n=39, classes=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, classes, (n,), generator=generator)
    # Informative scores, so no class is empty of predictions by chance alone.
    outputs = torch.randn(n, classes, generator=generator) + 1.5 * torch.nn.functional.one_hot(
        targets, classes
    )
    return outputs, targets


@pytest.mark.parametrize("average", ["macro", "micro", "weighted"])
def test_precision_recall_f1_match_sklearn_multiclass(average) -> None:
    outputs, targets = _classes()
    specs = [
        MetricSpec(name=name, args={"average": average}) for name in ("precision", "recall", "f1")
    ]
    got = _run(specs, _batches(outputs, targets))
    predicted = outputs.argmax(1).numpy()
    y = targets.numpy()
    options = {"average": average, "zero_division": 0}
    assert got["val/precision"] == pytest.approx(
        sklearn_metrics.precision_score(y, predicted, **options), abs=1e-12
    )
    assert got["val/recall"] == pytest.approx(
        sklearn_metrics.recall_score(y, predicted, **options), abs=1e-12
    )
    assert got["val/f1"] == pytest.approx(
        sklearn_metrics.f1_score(y, predicted, **options), abs=1e-12
    )


def test_macro_leaves_out_classes_in_neither_targets_nor_predictions() -> None:
    # 5 classes scored, class 4 never predicted nor a label: sklearn averages over 0-3.
    outputs = torch.tensor([[3.0, 0, 0, 0, 0], [0, 3, 0, 0, 0], [0, 0, 3, 0, 0], [0, 3, 0, 0, 0]])
    targets = torch.tensor([0, 1, 2, 3])
    got = _run(["f1"], [(outputs, targets)])
    expected = sklearn_metrics.f1_score([0, 1, 2, 3], [0, 1, 2, 1], average="macro")
    assert got["val/f1"] == pytest.approx(expected)  # (1 + 2/3 + 1 + 0) / 4


def test_binary_f1_from_one_logit_and_from_two_scores() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(39, 1, generator=generator)
    labels = (torch.rand(39, generator=generator) < 0.4).float()
    predicted = (logits[:, 0] > 0).long().numpy()
    expected = {
        "f1": sklearn_metrics.f1_score(labels.numpy(), predicted),
        "precision": sklearn_metrics.precision_score(labels.numpy(), predicted),
        "recall": sklearn_metrics.recall_score(labels.numpy(), predicted),
    }
    # One logit [N, 1] against 0/1 float labels [N] (BCEWithLogitsLoss's layout): its sign.
    got = _run(["f1", "precision", "recall"], _batches(logits, labels))
    # Two class scores against integer labels: the same predictions by argmax.
    two = torch.cat([torch.zeros_like(logits), logits], dim=1)
    got_two = _run(["f1", "precision", "recall"], _batches(two, labels.long()))
    for name, value in expected.items():
        assert got[f"val/{name}"] == pytest.approx(value)
        assert got_two[f"val/{name}"] == pytest.approx(value)
    # The positive class can be the other one.
    other = _run([MetricSpec(name="f1", args={"positive": 0})], [(two, labels.long())])
    assert other["val/f1"] == pytest.approx(
        sklearn_metrics.f1_score(labels.numpy(), predicted, pos_label=0)
    )


def test_multilabel_f1() -> None:
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(39, 3, generator=generator)
    labels = (torch.rand(39, 3, generator=generator) < 0.5).float()
    predicted = (logits > 0).long().numpy()
    for average in ("macro", "micro"):
        got = _run([MetricSpec(name="f1", args={"average": average})], _batches(logits, labels))
        expected = sklearn_metrics.f1_score(labels.numpy(), predicted, average=average)
        assert got["val/f1"] == pytest.approx(expected)


def test_token_level_metrics_leave_out_padding() -> None:
    generator = torch.Generator().manual_seed(3)
    outputs = torch.randn(6, 5, 7, generator=generator)  # [N, C, T]
    targets = torch.randint(0, 5, (6, 7), generator=generator)
    targets[:, -3:] = -100
    got = _run(["f1", "top2_accuracy"], [(outputs, targets)], ignore_index=-100)
    real = targets != -100
    y = targets[real].numpy()
    scores = outputs.permute(0, 2, 1)[real]  # [real tokens, C]
    assert got["val/f1"] == pytest.approx(
        sklearn_metrics.f1_score(y, scores.argmax(1).numpy(), average="macro", zero_division=0)
    )
    assert got["val/top2_accuracy"] == pytest.approx(
        sklearn_metrics.top_k_accuracy_score(y, scores.numpy(), k=2, labels=range(5))
    )


def test_top_k_accuracy_matches_sklearn() -> None:
    outputs, targets = _classes(classes=6)
    got = _run(["top1_accuracy", "top3_accuracy"], _batches(outputs, targets))
    scores, y = outputs.numpy(), targets.numpy()
    assert got["val/top1_accuracy"] == pytest.approx(
        sklearn_metrics.accuracy_score(y, scores.argmax(1))
    )
    assert got["val/top3_accuracy"] == pytest.approx(
        sklearn_metrics.top_k_accuracy_score(y, scores, k=3, labels=range(6))
    )


@pytest.mark.parametrize("average", ["uniform", "variance_weighted"])
def test_r2_matches_sklearn(average) -> None:
    generator = torch.Generator().manual_seed(4)
    # Targets far from 0 with a small spread: naive sums in float32 would lose R².
    targets = 1000 + torch.randn(39, 2, generator=generator) * torch.tensor([1.0, 3.0])
    outputs = targets + 0.5 * torch.randn(39, 2, generator=generator)
    got = _run([MetricSpec(name="r2", args={"average": average})], _batches(outputs, targets))
    expected = sklearn_metrics.r2_score(
        targets.double().numpy(),
        outputs.double().numpy(),
        multioutput="uniform_average" if average == "uniform" else "variance_weighted",
    )
    assert got["val/r2"] == pytest.approx(expected, abs=1e-6)


def test_r2_aligns_n_by_1_outputs_and_scores_constant_targets_as_sklearn() -> None:
    outputs = torch.tensor([[1.0], [2.0], [4.0]])
    targets = torch.tensor([1.0, 2.0, 3.0])
    got = _run(["r2"], [(outputs, targets)])
    assert got["val/r2"] == pytest.approx(sklearn_metrics.r2_score(targets, outputs[:, 0]))
    constant = torch.full((3,), 2.0)
    assert _run(["r2"], [(constant, constant)])["val/r2"] == 1.0
    assert _run(["r2"], [(targets, constant)])["val/r2"] == 0.0


def test_a_function_is_averaged_over_samples_not_batches() -> None:
    outputs, targets = _classes()

    def error_rate(outputs, targets):
        return (outputs.argmax(1) != targets).float().mean()

    got = _run([], _batches(outputs, targets), user=[(None, error_rate)])
    expected = (outputs.argmax(1) != targets).float().mean().item()
    assert got["val/error_rate"] == pytest.approx(expected)
    # The plain mean of the three batches' rates would be another number.
    per_batch = [error_rate(o, t).item() for o, t in _batches(outputs, targets)]
    assert abs(np.mean(per_batch) - expected) > 1e-3


def test_a_function_from_config_with_args(tmp_path) -> None:
    module = tmp_path / "my_metrics.py"
    module.write_text(
        "def shifted_mean(outputs, targets, shift=0.0):\n"
        "    return (outputs - targets).mean() + shift\n"
    )
    outputs, targets = torch.ones(4), torch.zeros(4)
    specs = [
        f"{module}:shifted_mean",
        MetricSpec(name=f"{module}:shifted_mean", args={"shift": 1.0}, key="plus_one"),
    ]
    got = _run(specs, [(outputs, targets)])
    assert got == {"val/shifted_mean": 1.0, "val/plus_one": 2.0}


def test_torchmetrics_objects_reduce_themselves_and_the_callers_object_is_untouched() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    outputs, targets = _classes()
    given = torchmetrics.classification.MulticlassF1Score(num_classes=4, average="macro")
    got = _run(["f1"], _batches(outputs, targets), user=[(None, given)])
    assert got["val/multiclass_f1_score"] == pytest.approx(got["val/f1"], abs=1e-6)
    assert given.update_count == 0  # a copy was updated, not the caller's object
    # From config, by import path with arguments; a dict result gives one figure per key.
    spec = MetricSpec(
        name="torchmetrics.classification:MulticlassAccuracy",
        args={"num_classes": 4, "average": "micro"},
        key="acc",
    )
    collection = torchmetrics.MetricCollection(
        {"p": torchmetrics.classification.MulticlassPrecision(num_classes=4)}
    )
    got = _run([spec], [(outputs, targets)], user=[(None, collection)])
    assert got["val/acc"] == pytest.approx((outputs.argmax(1) == targets).float().mean().item())
    assert set(got) == {"val/acc", "val/p"}
    # A metric's direction comes from the object.
    metrics = build_metrics([spec])
    assert monitor_mode("val/acc", "auto", metrics) == "max"


def test_listed_task_metrics_are_checked_not_computed_twice() -> None:
    outputs, targets = _classes()
    metrics = build_metrics(["accuracy", "f1"])
    run = metrics.start(device=CPU)
    run.update(outputs, targets)
    assert set(run.compute("val", reported={"val/loss": 1.0, "val/accuracy": 0.5})) == {"val/f1"}
    run = build_metrics(["mse"]).start(device=CPU)
    with pytest.raises(DataError, match="lists 'mse', but this run reports no val/mse"):
        run.compute("val", reported={"val/loss": 1.0, "val/accuracy": 0.5})


def test_building_errors_name_the_key_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"train.metrics\[0\]: f1 has no option averag"):
        build_metrics([MetricSpec(name="f1", args={"averag": "macro"})])
    with pytest.raises(ConfigError, match="average: 'mean' is not one of"):
        build_metrics([MetricSpec(name="f1", args={"average": "mean"})])
    with pytest.raises(ConfigError, match="two metrics report under the key 'f1'"):
        build_metrics(["f1", MetricSpec(name="f1", args={"average": "micro"})])
    with pytest.raises(ConfigError, match="the task's own metric"):
        build_metrics([MetricSpec(name="f1", key="accuracy")])
    with pytest.raises(ConfigError, match="lambda has no name"):
        build_metrics([], [(None, lambda o, t: o.mean())])
    with pytest.raises(ConfigError, match="not a metric"):
        build_metrics([], [("x", 3)])


def test_config_names_are_checked_when_the_config_is_read() -> None:
    with pytest.raises(ConfigError, match=r"'recal' is not a built-in metric \(did you mean"):
        validate_config({"train": {"metrics": ["recal"]}})
    config = validate_config(
        {"train": {"metrics": ["f1", "top5_accuracy", {"name": "r2", "key": "r_squared"}]}}
    )
    assert config.train.metrics[2] == MetricSpec(name="r2", key="r_squared")
    assert RunConfig().train.metrics == []


def test_batch_errors_name_the_metric_and_the_shapes() -> None:
    run = build_metrics(["top5_accuracy"]).start(device=CPU)
    with pytest.raises(DataError, match="scores 4 classes, fewer than k=5"):
        run.update(torch.randn(3, 4), torch.tensor([0, 1, 2]))
    run = build_metrics(["f1"]).start(device=CPU)
    with pytest.raises(DataError, match=r"cannot score the model's output \[3, 4\] against"):
        run.update(torch.randn(3, 4), torch.randn(3))
    # Labels past the classes are counted on the device, and reported with the figures.
    for labels, ignore_index in (([0, 1, 7], None), ([0, 4, -100], -100), ([-1, 1, 2], None)):
        run = build_metrics(["recall", "f1"]).start(device=CPU, ignore_index=ignore_index)
        run.update(torch.randn(3, 4), torch.tensor(labels))
        with pytest.raises(DataError, match="some labels are no class: negative, or 4 or more"):
            run.compute("val", reported={})
    run = build_metrics(["r2"]).start(device=CPU)
    with pytest.raises(DataError, match="not one shape"):
        run.update(torch.randn(3, 2), torch.randn(3))
    run = build_metrics([], [("per_sample", lambda o, t: (o - t).abs())]).start(device=CPU)
    with pytest.raises(DataError, match="returned a tensor of shape \\[3\\]"):
        run.update(torch.randn(3), torch.randn(3))


def test_monitor_mode() -> None:
    metrics = build_metrics(["f1", "r2"], [("dist", lambda o, t: (o - t).abs().mean())])
    assert monitor_mode("val/f1", "auto", metrics) == "max"
    assert monitor_mode("val/r2", "auto", metrics) == "max"
    assert monitor_mode("val/accuracy", "auto", metrics) == "max"
    assert monitor_mode("val/loss", "auto", metrics) == "min"
    assert monitor_mode("val/dist", "min", metrics) == "min"
    with pytest.raises(ConfigError, match="cannot tell whether a higher"):
        monitor_mode("val/dist", "auto", metrics)
    with pytest.raises(ConfigError, match="evaluated once, at the end"):
        monitor_mode("test/f1", "auto", metrics)


def test_fit_metrics_split_into_config_and_objects() -> None:
    def dist(o, t):
        return (o - t).abs().mean()

    config, objects = split_fit_metrics(["f1", {"name": "r2"}, dist])
    assert config == ["f1", {"name": "r2"}] and objects == [(None, dist)]
    config, objects = split_fit_metrics(
        {"f1_micro": {"name": "f1", "args": {"average": "micro"}}, "d": dist}
    )
    assert config == [{"name": "f1", "args": {"average": "micro"}, "key": "f1_micro"}]
    assert objects == [("d", dist)]
    assert split_fit_metrics(None) == ([], [])


@pytest.mark.cuda
def test_the_built_ins_on_a_gpu_equal_the_cpus() -> None:
    outputs, targets = _classes()
    specs = ["f1", "precision", "recall", "top2_accuracy"]
    cuda = torch.device("cuda")
    on_cpu = _run(specs, _batches(outputs, targets))
    run = build_metrics(specs).start(device=cuda, ignore_index=-100)
    for o, t in _batches(outputs.to(cuda), targets.to(cuda)):
        run.update(o, t)
    on_gpu = run.compute("val", reported={})
    for key, value in on_cpu.items():
        assert on_gpu[key] == pytest.approx(value, abs=1e-12), key
    real = 1000 + torch.randn(39, 2)
    predicted = real + torch.randn(39, 2)
    run = build_metrics(["r2"]).start(device=cuda)
    run.update(predicted.to(cuda), real.to(cuda))
    expected = _run(["r2"], [(predicted, real)])["val/r2"]
    assert run.compute("val", reported={})["val/r2"] == pytest.approx(expected, abs=1e-9)
