"""The run's metrics besides the task's own (``train.metrics``, ``stoker.fit(metrics=...)``):
built from names, import paths and objects, updated per evaluation batch, and reduced
over the ranks.

Three kinds of metric:

- built-ins (``f1``, ``precision``, ``recall``, ``top<k>_accuracy``, ``r2``) and a user's
  function ``(outputs, targets) -> number`` keep sums (``stoker.train.metric_defs``);
  every rank's sums are combined with one all-reduce before any figure is computed;
- a stateful object with ``update``/``compute``/``reset`` (a torchmetrics ``Metric``)
  keeps its own state, and torchmetrics reduces it over the ranks in ``compute``;
- the task's own names (``accuracy``, ``mse``, ...) are reported by ``TaskMetrics``
  anyway; listing one checks that the run reports it.

They are computed on the validation and test data, not per training step: they cost
nothing while training, and with none configured an evaluation pays one empty loop.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist

from stoker.components import resolve_callable
from stoker.config import BUILTIN_METRICS, TASK_METRICS, TOP_K_METRIC, MetricSpec
from stoker.data.samplers import rank_and_world_size
from stoker.errors import ConfigError, DataError
from stoker.train.losses import aligned_shapes
from stoker.train.metric_defs import (
    ClassCounts,
    MeanOf,
    RSquared,
    SumMetric,
    TopKAccuracy,
    sums_dtype,
)

#: Options of each built-in, checked when the metric is built.
_OPTIONS = {
    "precision": {"average", "positive"},
    "recall": {"average", "positive"},
    "f1": {"average", "positive", "beta"},
    "r2": {"average"},
}
_AVERAGES = {
    "precision": ("auto", "binary", "macro", "micro", "weighted"),
    "r2": ("uniform", "variance_weighted"),
}
#: Keys where a higher value is better (for ``train.monitor_mode: auto``).
_HIGHER = frozenset({"accuracy", *BUILTIN_METRICS})


class ObjectMetric:
    """A stateful metric object (torchmetrics): ``update`` per batch, ``compute`` once."""

    def __init__(self, key: str, metric: Any, *, name: str) -> None:
        self.key, self.metric, self.name = key, metric, name

    def start(self, device: torch.device, dtype: torch.dtype) -> None:
        """Move the metric object to ``device`` and reset it."""
        if hasattr(self.metric, "to"):
            self.metric.to(device)
        self.metric.reset()

    def update(self, outputs: Any, targets: Any) -> None:
        """Feed one batch to the metric object, shapes aligned as for the built-ins."""
        if isinstance(outputs, torch.Tensor) and isinstance(targets, torch.Tensor):
            outputs, targets = aligned_shapes(outputs, targets) or (outputs, targets)
        try:
            self.metric.update(outputs, targets)
        except Exception as error:
            raise DataError(
                f"metric {self.key!r} ({self.name}).update failed on outputs "
                f"{_shape(outputs)} and targets {_shape(targets)}: "
                f"{type(error).__name__}: {error}",
                hint="check the metric's arguments (num_classes, task) against the model's output",
            ) from error

    def compute(self, prefix: str) -> dict[str, float]:
        """Every rank must call this (torchmetrics all-gathers its state here)."""
        value = self.metric.compute()
        self.metric.reset()
        if isinstance(value, Mapping):
            return {f"{prefix}/{name}": self._number(item, name) for name, item in value.items()}
        return {f"{prefix}/{self.key}": self._number(value, self.key)}

    def _number(self, value: Any, key: str) -> float:
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise DataError(
                    f"metric {key!r} ({self.name}) computed a tensor of shape "
                    f"{list(value.shape)}; a metric is one number",
                    hint="average it (e.g. average='macro'), or return a dict of numbers",
                )
            return float(value.item())  # a sync point on a GPU
        return float(value)


@dataclass(frozen=True)
class MetricDef:
    """One configured metric: how to make a fresh accumulator, and its direction."""

    key: str
    name: str  # as the config or the caller gave it, for messages
    kind: Literal["task", "sums", "object"]
    make: Any  # (ignore_index) -> SumMetric | ObjectMetric; None for a task metric
    higher_is_better: bool | None


class MetricRun:
    """One evaluation's accumulators (validation after an epoch, or the test)."""

    def __init__(self, metrics: Sequence[SumMetric | ObjectMetric], task_keys: Sequence[str]):
        self.metrics, self.task_keys = tuple(metrics), tuple(task_keys)
        self.sums = tuple(m for m in self.metrics if isinstance(m, SumMetric))
        # Precision, recall and F1 count once, in the first of them (its "leader").
        for index, metric in enumerate(self.sums):
            metric.leader = next(
                (m for m in self.sums[:index] if m.leader is None and m.shares(metric)), None
            )
        self.updated = tuple(m for m in self.metrics if getattr(m, "leader", None) is None)

    def update(self, outputs: Any, targets: Any) -> None:
        """Feed one batch to every metric that is updated per batch."""
        for metric in self.updated:
            metric.update(outputs, targets)

    def compute(self, prefix: str, *, reported: Mapping[str, float]) -> dict[str, float]:
        """The figures under ``prefix/``, over every rank (each rank must call this).

        ``reported`` holds the task's figures: a listed task metric must be among them.
        """
        values: dict[str, float] = {}
        if self.sums:
            for metric, figure in zip(self.sums, _reduced(self.sums), strict=True):
                if figure is not None:
                    values[f"{prefix}/{metric.key}"] = figure
        for metric in self.metrics:
            if isinstance(metric, ObjectMetric):
                values.update(metric.compute(prefix))
        for key in self.task_keys:
            if f"{prefix}/{key}" not in reported and reported:
                raise DataError(
                    f"train.metrics lists {key!r}, but this run reports no {prefix}/{key} "
                    f"(it reports {', '.join(sorted(reported))})",
                    hint="accuracy needs class scores against labels, mse and mae a "
                    "regression task, perplexity token-level cross entropy; drop it from "
                    "train.metrics or set train.task",
                )
        return values


def _reduced(metrics: Sequence[SumMetric]) -> list[float | None]:
    """Each metric's figure from its sums added over the ranks: one all-reduce of every
    sum (and one of the row counts, so a rank that saw no batch pads its rows with zeros)."""
    sums = [m.sums() for m in metrics]
    device = sums[0][0].device
    if device.type == "mps":
        device = torch.device("cpu")  # no float64
    heads = [head.to(device, torch.float64) for head, _ in sums]
    rows = [rows.to(device, torch.float64) for _, rows in sums]
    if rank_and_world_size()[1] > 1:
        counts = torch.tensor([r.shape[0] for r in rows], dtype=torch.long, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        rows = [
            torch.cat((r, r.new_zeros(int(n) - r.shape[0], r.shape[1])))
            for r, n in zip(rows, counts.tolist(), strict=True)
        ]
    flat = torch.cat([*heads, *(r.flatten() for r in rows)])
    if rank_and_world_size()[1] > 1:
        dist.all_reduce(flat)
    numbers = flat.tolist()  # the sync point
    figures: list[float | None] = []
    offset = sum(h.numel() for h in heads)
    at = 0
    for metric, head, row in zip(metrics, heads, rows, strict=True):
        head_values = numbers[at : at + head.numel()]
        at += head.numel()
        size = row.numel()
        flat_rows = numbers[offset : offset + size]
        offset += size
        width = max(row.shape[1], 1)
        matrix = [flat_rows[i : i + width] for i in range(0, size, width)]
        figures.append(metric.values(head_values, matrix))
    return figures


class Metrics:
    """The run's configured metrics; :meth:`start` makes one evaluation's accumulators."""

    def __init__(self, defs: Sequence[MetricDef] = ()) -> None:
        self.defs = tuple(defs)
        self.by_key = {d.key: d for d in self.defs}

    def __bool__(self) -> bool:
        return bool(self.defs)

    def start(self, *, device: torch.device, ignore_index: int | None = None) -> MetricRun:
        """Begin an evaluation: fresh sums on ``device`` for every requested metric."""
        made = [d.make(ignore_index) for d in self.defs if d.kind != "task"]
        dtype = sums_dtype(device)
        for metric in made:
            metric.start(device, dtype)
        return MetricRun(made, [d.key for d in self.defs if d.kind == "task"])


NO_METRICS = Metrics()


def build_metrics(
    specs: Sequence[str | MetricSpec | Mapping[str, Any]],
    user: Iterable[tuple[str | None, Any]] = (),
) -> Metrics:
    """The metrics ``train.metrics`` names, then those given to ``stoker.fit`` as objects.

    Raises:
        ConfigError: An unknown option, an import path that is no metric, a key used twice,
            or (in a distributed run) a stateful metric that cannot reduce itself.
    """
    defs = [_from_spec(spec, field=f"train.metrics[{i}]") for i, spec in enumerate(specs)]
    for key, value in user:
        defs.append(_from_object(value, key=key, name=_describe(value), field="fit(metrics=...)"))
    seen: set[str] = set()
    for d in defs:
        if d.key in seen:
            raise ConfigError(
                f"train.metrics: two metrics report under the key {d.key!r}",
                hint="give one a key of its own: {name: ..., key: other_name} (or a dict "
                "{key: metric} to stoker.fit)",
            )
        if d.kind != "task" and d.key in TASK_METRICS:
            raise ConfigError(
                f"train.metrics: {d.name} would report under {d.key!r}, the task's own "
                "metric of that name",
                hint=f"give it a key of its own: {{name: {d.name}, key: my_{d.key}}}",
            )
        seen.add(d.key)
    return Metrics(defs)


def _from_spec(item: str | MetricSpec | Mapping[str, Any], *, field: str) -> MetricDef:
    if isinstance(item, str):
        spec = MetricSpec(name=item)
    else:
        spec = item if isinstance(item, MetricSpec) else MetricSpec.model_validate(item)
    name, args = spec.name, dict(spec.args)
    if ":" in name:
        if name.startswith("torchmetrics") and importlib.util.find_spec("torchmetrics") is None:
            raise ConfigError(
                f"{field}: {name} needs torchmetrics, which is not installed",
                hint="pip install 'stoker[metrics]'",
            )
        target = resolve_callable(name, field=field, builtins={})
        key = spec.key or _default_key(target, name.rpartition(":")[2].rpartition(".")[2])
        if isinstance(target, type):
            try:
                value = target(**args)
            except TypeError as error:
                raise ConfigError(
                    f"{field}: {name}(**{args}) failed: {error}", hint=f"check {field}.args"
                ) from None
        else:
            value = functools.partial(target, **args) if args else target
        return _from_object(value, key=key, name=name, field=field)
    key = spec.key or name
    if name in TASK_METRICS:
        if args or key != name:
            raise ConfigError(
                f"{field}: {name} is the task's own metric: it takes no args and keeps its key",
                hint=f"list it as `{name}`",
            )
        return MetricDef(key, name, "task", None, _higher(name))
    unknown = set(args) - _OPTIONS.get(name, set())
    if unknown:
        allowed = ", ".join(sorted(_OPTIONS.get(name, ()))) or "none"
        raise ConfigError(
            f"{field}: {name} has no option {', '.join(sorted(unknown))}",
            hint=f"its options: {allowed}",
        )
    if "average" in args:
        choices = _AVERAGES["r2" if name == "r2" else "precision"]
        if args["average"] not in choices:
            raise ConfigError(
                f"{field}.args.average: {args['average']!r} is not one of {', '.join(choices)}"
            )
    match = TOP_K_METRIC.fullmatch(name)
    if match:
        k = int(match[1])
        make = functools.partial(_top_k, key, k)
    elif name == "r2":
        make = functools.partial(_r2, key, args)
    else:
        make = functools.partial(_class_counts, key, name, args)
    return MetricDef(key, name, "sums", make, True)


def _top_k(key: str, k: int, ignore_index: int | None) -> SumMetric:
    return TopKAccuracy(key, k, ignore_index=ignore_index)


def _r2(key: str, args: dict[str, Any], ignore_index: int | None) -> SumMetric:
    return RSquared(key, **args)


def _class_counts(
    key: str, which: Any, args: dict[str, Any], ignore_index: int | None
) -> SumMetric:
    return ClassCounts(key, which, ignore_index=ignore_index, **args)


def _from_object(value: Any, *, key: str | None, name: str, field: str) -> MetricDef:
    """A stateful object (``update``/``compute``/``reset``) or a function of one batch."""
    key = key or _default_key(value, None)
    if key is None:
        raise ConfigError(
            f"{field}: a lambda has no name to report its metric under",
            hint="give it a key: stoker.fit(..., metrics={'my_metric': lambda o, t: ...})",
        )
    if all(callable(getattr(value, method, None)) for method in ("update", "compute", "reset")):
        _check_reduces(value, name=name, field=field)
        own = copy.deepcopy(value)  # the caller's object is left as it was given
        higher = getattr(value, "higher_is_better", None)
        return MetricDef(
            key,
            name,
            "object",
            lambda ignore_index: ObjectMetric(key, own, name=name),
            higher if isinstance(higher, bool) else None,
        )
    if callable(value):
        return MetricDef(
            key,
            name,
            "sums",
            lambda ignore_index: MeanOf(key, value, name=name),
            getattr(value, "higher_is_better", None),
        )
    raise ConfigError(
        f"{field}: {name} is a {type(value).__name__}, not a metric",
        hint="give a function (outputs, targets) -> number, or an object with update, "
        "compute and reset (a torchmetrics Metric)",
    )


def _check_reduces(value: Any, *, name: str, field: str) -> None:
    """In a distributed run a stateful metric must combine the ranks' states itself."""
    if rank_and_world_size()[1] == 1:
        return
    torchmetrics = sys.modules.get("torchmetrics")
    if torchmetrics is None or not isinstance(value, torchmetrics.Metric):
        raise ConfigError(
            f"{field}: {name} keeps its own state, and stoker cannot tell how to combine "
            "the ranks' states in a distributed run",
            hint="use a torchmetrics Metric (it reduces itself), a built-in, or a function "
            "(outputs, targets) -> number, which stoker averages over every sample",
        )
    if getattr(value, "sync_on_compute", True) is False:
        raise ConfigError(
            f"{field}: {name} has sync_on_compute=False, so each rank would report its "
            "own share of the data",
            hint="leave sync_on_compute at its default (True)",
        )


def _default_key(value: Any, fallback: str | None) -> str | None:
    """A function's name, or a class's (or an instance's class's) in snake case
    (``MulticlassF1Score`` → ``multiclass_f1_score``); ``fallback`` for a lambda."""
    if isinstance(value, functools.partial):
        value = value.func
    if hasattr(value, "__code__"):  # a Python function
        return fallback if value.__name__ == "<lambda>" else value.__name__
    if not isinstance(value, type) and isinstance(getattr(value, "__name__", None), str):
        return value.__name__  # a builtin function
    name = (value if isinstance(value, type) else type(value)).__name__
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", name).lower()


def _describe(value: Any) -> str:
    if isinstance(value, functools.partial):
        value = value.func
    return getattr(value, "__qualname__", None) or type(value).__name__


def _higher(name: str) -> bool | None:
    if name in _HIGHER or TOP_K_METRIC.fullmatch(name):
        return True
    return False if name in ("loss", "perplexity", "mse", "mae") else None


def _shape(value: Any) -> str:
    return str(list(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def monitor_mode(metric: str, mode: str, metrics: Metrics) -> Literal["min", "max"]:
    """The direction of ``train.monitor``: ``mode`` unless ``auto``.

    ``auto``: a configured metric's own direction (built-ins, torchmetrics'
    ``higher_is_better``); else max for accuracy, min otherwise.

    Raises:
        ConfigError: The monitor names a test metric (evaluated once, at the end), or a
            metric of the user's whose direction is unknown.
    """
    if metric.startswith("test/"):
        raise ConfigError(
            f"train.monitor={metric}: the test data is evaluated once, at the end of the run, "
            "so it cannot pick the best epoch",
            hint=f"monitor a validation metric, e.g. train.monitor=val/{metric[5:]}",
        )
    if mode != "auto":
        return mode  # type: ignore[return-value]
    found = metrics.by_key.get(metric.partition("/")[2])
    if found is not None and found.kind != "task":
        if found.higher_is_better is None:
            raise ConfigError(
                f"train.monitor={metric}: stoker cannot tell whether a higher {found.name} "
                "is better",
                hint="set train.monitor_mode to max or min",
            )
        return "max" if found.higher_is_better else "min"
    name = metric.partition("/")[2]
    return "max" if "accuracy" in metric or _higher(name) else "min"


def split_fit_metrics(value: Any) -> tuple[list[Any], list[tuple[str | None, Any]]]:
    """``stoker.fit(metrics=...)``: (config items, objects) from a list or a ``{key: metric}``.

    Names and ``{name, args, key}`` mappings go to the config (and ``config.yaml``); the
    functions and metric objects are kept as Python objects, with their keys.
    """
    if value is None:
        return [], []
    if isinstance(value, Mapping) and "name" not in value:
        items: list[tuple[str | None, Any]] = list(value.items())
    elif isinstance(value, (str, Mapping)) or not isinstance(value, Iterable):
        items = [(None, value)]
    else:
        items = [(None, item) for item in value]
    config: list[Any] = []
    objects: list[tuple[str | None, Any]] = []
    for key, item in items:
        if isinstance(item, str):
            config.append(item if key is None else {"name": item, "key": key})
        elif isinstance(item, Mapping):
            config.append(dict(item) if key is None else {**item, "key": key})
        else:
            objects.append((key, item))
    return config, objects
