"""The typed run config: pydantic models, YAML loading and ``key.sub=value`` overrides."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)

from stoker.config_paths import resolve_paths
from stoker.config_problems import describe_problems, suggest
from stoker.errors import ConfigError

Precision = Literal["fp32", "bf16", "fp16"]


class Section(BaseModel):
    """A config section: unknown keys are errors, not silently ignored."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ComponentSpec(Section):
    """A model, dataset or loss given by built-in name or as ``module:callable``."""

    name: str = Field(
        description="Built-in name, or an import path `module:callable` / `file.py:callable`."
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for it.")


class MetricSpec(Section):
    """A metric with arguments, or under a key of its own (``train.metrics`` items)."""

    name: str = Field(
        description="A built-in metric, or an import path `module:callable` / `file.py:Class`."
    )
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments: a built-in's options, a class's constructor arguments, "
        "or extra keyword arguments of a function.",
    )
    key: str | None = Field(
        None, description="The name in records (`val/<key>`); defaults to the metric's name."
    )


#: The task's own metrics: reported whenever the outputs allow, listing them checks that.
TASK_METRICS = ("loss", "accuracy", "perplexity", "mse", "mae")
#: Built-in metrics computed on request (``train.metrics``), besides ``top<k>_accuracy``.
BUILTIN_METRICS = ("precision", "recall", "f1", "r2")
TOP_K_METRIC = re.compile(r"top([1-9][0-9]*)_accuracy")


def check_metric_name(name: str) -> None:
    """Raise ValueError unless ``name`` is a built-in metric or an import path."""
    if ":" in name or name in TASK_METRICS or name in BUILTIN_METRICS:
        return
    if TOP_K_METRIC.fullmatch(name):
        return
    known = (*TASK_METRICS, *BUILTIN_METRICS, "top5_accuracy")
    raise ValueError(
        f"{name!r} is not a built-in metric{suggest(name, known)}; built-ins: "
        f"{', '.join(known)} (any top<k>_accuracy), or an import path such as "
        "`metrics.py:my_metric` or `torchmetrics.classification:MulticlassF1Score`"
    )


class DataConfig(Section):
    """Where the samples come from."""

    train: ComponentSpec | None = Field(None, description="The training dataset.")
    val: ComponentSpec | None = Field(None, description="The validation dataset (optional).")
    val_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Hold out this share of `train` for validation when `val` is not given.",
    )
    test: ComponentSpec | None = Field(
        None,
        description="The test dataset (optional), evaluated once at the end of the run and "
        "reported as `test/*`.",
    )
    test_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Hold out this share of `train` for the test when `test` is not given "
        "(apart from the `val_fraction` share).",
    )
    test_checkpoint: Literal["auto", "best", "last"] = Field(
        "auto",
        description="The weights the test evaluates: `best` (the best checkpoint by "
        "`train.monitor`), `last` (the final weights); `auto`: best when the run keeps a best "
        "checkpoint, else last.",
    )
    split_seed: int = Field(0, description="Seed of the deterministic train/val/test split.")
    fingerprint: Literal["fast", "full", "off"] = Field(
        "fast",
        description=(
            "Content fingerprint of the training data, checked on resume: `fast` hashes sizes "
            "and sampled blocks, `full` every byte, `off` none (YAML reads a bare `off` as "
            "false, which means `off` here too)."
        ),
    )
    cache: Literal["none", "memory", "disk"] = Field(
        "none",
        description="Do per-sample work once. `memory`: a deterministic Dataset is read once "
        "into arrays and served by batched gathers (else each sample is kept as read); an "
        "image folder is decoded once into uint8 arrays, its crops and flips replayed per "
        "batch. `disk`: the same kept in files under `cache_path`, for workers and later runs.",
    )
    cache_path: str | None = Field(
        None, description="Folder of the disk cache (`.npy` files), reused while the data is."
    )
    bad_records: Literal["error", "skip"] = Field(
        "error",
        description="`error`: stop at a malformed record; `skip`: log it to bad_records.jsonl.",
    )
    max_bad_records: PositiveInt = Field(
        1000, description="Stop after more distinct bad records than this (train and val together)."
    )
    max_consecutive_bad_records: PositiveInt = Field(
        100, description="Stop after more skips in a row than this."
    )

    @model_validator(mode="after")
    def _one_test_source(self) -> DataConfig:
        if self.test is not None and self.test_fraction is not None:
            raise ValueError(
                "data.test and data.test_fraction are both set; give a test dataset or a "
                "fraction of train, not both"
            )
        shares = (self.val_fraction or 0.0) + (self.test_fraction or 0.0)
        if self.val is None and self.test is None and shares >= 1.0:
            raise ValueError(
                f"data.val_fraction + data.test_fraction is {shares:g}, which leaves no "
                "training data; make their sum less than 1"
            )
        return self

    @field_validator("fingerprint", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 (PyYAML) turns `fingerprint: off` into False before pydantic sees it.
        return "off" if value is False else value


class LoaderConfig(Section):
    """How samples are batched and delivered (every DataLoader knob the seeds teach)."""

    batch_size: PositiveInt = Field(64, description="Samples per batch (per micro-batch).")
    val_batch_size: PositiveInt | None = Field(None, description="Defaults to `batch_size`.")
    shuffle: bool | Literal["auto"] = Field(
        "auto", description="`auto`: shuffle map-style training data; a stream keeps its order."
    )
    drop_last: bool = Field(False, description="Drop the last, smaller batch of each epoch.")
    sampler: Literal["auto", "sequential", "random", "weighted", "bucket"] = Field(
        "auto",
        description=(
            "`auto`: weighted if weights are given, else random when shuffling; `bucket`: "
            "batches of similar length (the dataset's lengths()), to pad less."
        ),
    )
    bucket_size_multiplier: PositiveInt = Field(50, description="`bucket`: batches per bucket.")
    weights: Literal["balanced"] | list[NonNegativeFloat] | None = Field(
        None, description="Per-sample weights for `sampler: weighted`, or `balanced` (by class)."
    )
    num_workers: NonNegativeInt = Field(
        0, description="Loader worker processes; 0 loads in the training process."
    )
    pin_memory: bool | Literal["auto"] = Field(
        "auto", description="`auto`: on when training on CUDA."
    )
    persistent_workers: bool = Field(
        False, description="Keep workers alive between epochs (needs num_workers > 0)."
    )
    prefetch_factor: PositiveInt | None = Field(
        None, description="Batches each worker loads ahead (needs num_workers > 0)."
    )
    timeout_s: NonNegativeFloat = Field(
        300.0,
        description="A worker that delivers no batch for this long is an error that shows "
        "its stack; 0 waits forever (with num_workers > 0).",
    )
    collate_fn: str | None = Field(
        None, description="`pad` (pad + attention mask), or an import path `module:callable`."
    )
    collate_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the collate function, e.g. {max_length: 256}.",
    )


class LossConfig(Section):
    """The loss function."""

    name: str = Field(
        "cross_entropy",
        description=(
            "cross_entropy, nll, bce_with_logits, mse, l1, smooth_l1, huber, or `module:callable`."
        ),
    )
    args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for it.")
    normalize: Literal["samples", "tokens"] = Field(
        "samples",
        description=(
            "How micro-batch losses are weighted in an accumulated step: by samples, or by "
            "real tokens (targets != ignore_index) for token-level losses over padded batches."
        ),
    )
    ignore_index: int = Field(-100, description="Target value of padding, with normalize=tokens.")


#: The built-in optimizers and schedules; any other ``name`` is an import path.
OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine", "step", "onecycle")


def _builtin_or_import_path(value: str, builtins: tuple[str, ...]) -> str:
    if value in builtins or ":" in value:
        return value
    raise ValueError(
        f"{value!r} is neither one of {', '.join(builtins)} nor an import path "
        "`module:Class` / `file.py:factory`"
    )


class OptimConfig(Section):
    """The optimizer."""

    name: str = Field(
        "adamw",
        description="adamw, adam, sgd, or an import path `module:Class` / `file.py:Class` of "
        "any torch.optim.Optimizer, called with the parameters, `lr`, `weight_decay` (when "
        "set) and `args`.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of an import-path optimizer."
    )
    lr: PositiveFloat = Field(1e-3, description="Base learning rate (the peak of a schedule).")
    weight_decay: NonNegativeFloat | None = Field(
        None, description="Defaults to PyTorch's default."
    )
    momentum: NonNegativeFloat = Field(0.9, description="SGD only.")
    nesterov: bool = Field(False, description="SGD only.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="Adam and AdamW only.")
    eps: PositiveFloat = Field(1e-8, description="Adam and AdamW only: the denominator's epsilon.")
    fused: bool | Literal["auto"] = Field(
        "auto", description="`auto`: the fused kernel where PyTorch has one for the device."
    )

    @field_validator("name")
    @classmethod
    def _known_name(cls, value: str) -> str:
        return _builtin_or_import_path(value, OPTIMIZERS)


class ScheduleConfig(Section):
    """The learning-rate schedule, stepped once per optimizer step."""

    name: str = Field(
        "constant",
        description="The schedule after warmup: constant, cosine, step, onecycle, or an import "
        "path `file.py:factory` called as `factory(optimizer, **args)` (and `total_steps=` "
        "when it takes it) that returns an LR scheduler.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments of an import-path schedule."
    )
    warmup_steps: NonNegativeInt = Field(0, description="Linear warmup before the schedule.")
    total_steps: PositiveInt | None = Field(
        None,
        description="Horizon of cosine/onecycle after warmup; defaults to the rest of the run.",
    )
    min_lr: NonNegativeFloat = Field(0.0, description="Cosine floor (`eta_min`).")
    step_size: PositiveInt = Field(1000, description="`step`: decay every this many steps.")
    gamma: PositiveFloat = Field(0.1, description="`step`: decay factor.")
    pct_start: float = Field(0.3, gt=0, lt=1, description="`onecycle`: share of steps rising.")
    div_factor: PositiveFloat = Field(25.0, description="`onecycle`: initial lr = lr / div_factor.")
    final_div_factor: PositiveFloat = Field(1e4, description="`onecycle`: final lr divisor.")

    @field_validator("name")
    @classmethod
    def _known_name(cls, value: str) -> str:
        return _builtin_or_import_path(value, SCHEDULES)


class EarlyStoppingConfig(Section):
    """Stop when the monitored metric stops improving."""

    patience: PositiveInt = Field(5, description="Epochs without improvement before stopping.")
    min_delta: NonNegativeFloat = Field(0.0, description="Smallest change that counts.")


class TrainConfig(Section):
    """The loop."""

    epochs: PositiveInt = Field(10, description="Passes over the training data.")
    max_steps: PositiveInt | None = Field(None, description="Stop after this many optimizer steps.")
    grad_accum_steps: PositiveInt = Field(1, description="Micro-batches per optimizer step.")
    clip_grad_norm: PositiveFloat | None = Field(None, description="Clip the total gradient norm.")
    clip_grad_value: PositiveFloat | None = Field(None, description="Clip each gradient value.")
    precision: Precision = Field(
        "fp32", description="fp32, bf16 (autocast), or fp16 (autocast + loss scaling)."
    )
    device: str = Field(
        "auto", description="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps."
    )
    compile: bool = Field(False, description="Wrap the model in torch.compile.")
    threads: PositiveInt | Literal["auto"] = Field(
        "auto",
        description="PyTorch intra-op threads (torch.set_num_threads). `auto`: the cores this "
        "process may use, less one per loader worker and the cores other processes keep "
        "busy at the start, at least 1 (OMP_NUM_THREADS, when set, is kept).",
    )
    prefetch: bool | Literal["auto"] = Field(
        "auto",
        description="Copy the next batch to the GPU on a side stream during the step "
        "(`auto`: on with CUDA).",
    )
    task: Literal["auto", "classification", "regression", "none"] = Field(
        "auto",
        description="Which metrics to report; `auto` infers it from the loss; `none`: the "
        "loss alone.",
    )
    metrics: list[str | MetricSpec] = Field(
        default_factory=list,
        description="Metrics of the validation and test data besides the task's own (loss, "
        "accuracy or mse/mae): f1, precision, recall, top<k>_accuracy, r2, or an import path "
        "of a function `(outputs, targets) -> tensor` or a metric class (torchmetrics).",
    )
    monitor: str | None = Field(
        None, description="Metric for best checkpoint and early stopping; val/loss or train/loss."
    )
    monitor_mode: Literal["auto", "min", "max"] = Field(
        "auto",
        description="`auto`: max for accuracy, f1, precision, recall and r2 (and a torchmetrics "
        "metric's `higher_is_better`), min otherwise.",
    )
    early_stopping: EarlyStoppingConfig | None = None
    step_fn: str | None = Field(
        None,
        description="Import path `file.py:function` of a `step_fn(model, batch)` that returns "
        "the loss, or a dict with `loss` and other values (logged as train/<name>); it "
        "replaces the model's forward and the loss.",
    )
    eval_fn: str | None = Field(
        None, description="The same for validation (`val/<name>`); defaults to `step_fn`."
    )
    log_every_steps: PositiveInt = Field(50, description="Steps between step-level metric records.")
    grad_health_every: NonNegativeInt = Field(
        100,
        description="Record per-layer gradient norms and update/weight ratios every this many "
        "steps (0: off).",
    )
    on_nonfinite: Literal["halt", "skip", "rollback"] = Field(
        "halt",
        description="What a NaN/inf loss or gradient does: `halt` stops with an error naming "
        "the step and the first parameter with a bad gradient; `skip` drops the step "
        "(parameters and optimizer state unchanged); `rollback` restores the newest valid "
        "checkpoint and goes on with the batches after the bad one.",
    )
    max_skipped_steps: PositiveInt = Field(
        10,
        description="With on_nonfinite=skip, the run stops with an error at the next bad step "
        "once this many were skipped: a run that keeps producing NaN has diverged.",
    )
    max_rollbacks: PositiveInt = Field(
        3,
        description="With on_nonfinite=rollback, the run stops with an error at the next bad "
        "step once it rolled back this many times.",
    )
    min_loss_scale: PositiveFloat = Field(
        1.0,
        description="fp16: a loss scale that falls below this is an error, not silent skipping. "
        "Below 1 the scaler shrinks gradients, which only a model whose gradients overflow "
        "fp16 unscaled (or are inf/NaN at any scale) needs (DeepSpeed's default too).",
    )

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, metrics: list[str | MetricSpec]) -> list[str | MetricSpec]:
        for item in metrics:
            check_metric_name(item if isinstance(item, str) else item.name)
        return metrics

    @model_validator(mode="after")
    def _one_clipping_mode(self) -> TrainConfig:
        if self.clip_grad_norm is not None and self.clip_grad_value is not None:
            raise ValueError(
                "clip_grad_norm and clip_grad_value are both set; choose one "
                "(set the other to null)"
            )
        return self


class CheckpointConfig(Section):
    """Checkpoints: at the end of each epoch, every N steps, and when stopped by a signal."""

    enabled: bool = Field(True, description="Write checkpoints at all.")
    every_steps: PositiveInt | None = Field(
        None, description="Also checkpoint every this many optimizer steps (mid-epoch)."
    )
    keep_last: PositiveInt = Field(
        3, description="How many of the newest checkpoints to keep (mid-epoch ones count too)."
    )
    keep_best: bool = Field(
        True, description="Also keep the best checkpoint (`best.json`) by the monitored metric."
    )
    async_save: bool = Field(
        False,
        description="FSDP: write the shards in the background; the step waits only for "
        "their copy to CPU memory, and the checkpoint counts once written (its marker).",
    )


class TrackingConfig(Section):
    """Where the run writes."""

    run_dir: str | None = Field(None, description="Defaults to `<runs_root>/<name>-<timestamp>`.")
    runs_root: str = Field("runs", description="The folder that holds the run dirs.")
    tensorboard: bool | Literal["auto"] = Field(
        "auto", description="TensorBoard event files under `tb/`; `auto`: when installed."
    )
    mlflow: bool = Field(False, description="Also log to MLflow (pip install 'stoker[mlflow]').")
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI; default: SQLite `mlflow.db` beside the run dirs."
    )
    mlflow_experiment: str = Field("stoker", description="The MLflow experiment's name.")
    progress_every_s: PositiveFloat | None = Field(
        30.0,
        description="Plain progress (a log, CI): a line with the step, loss, samples/s and the "
        "epoch's and the run's ETA this often, mid-epoch too; null: epoch summaries only.",
    )
    progress_every_steps: PositiveInt | None = Field(
        None, description="Plain progress: also a line every this many optimizer steps."
    )


class DistributedConfig(Section):
    """Several processes under torchrun (`stoker train --nproc N`); ignored in one process."""

    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend; `auto`: NCCL on CUDA, gloo on CPU."
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="`ddp`: a full model copy per rank; `fsdp`: parameters, gradients and "
        "optimizer state sharded across ranks (FSDP2 `fully_shard`).",
    )
    timeout_s: PositiveFloat = Field(
        600.0,
        description="A collective that waits longer fails on every rank, naming the rank "
        "that did not arrive; a rank that makes no progress for this long exits with its stack.",
    )
    find_unused_parameters: bool = Field(
        False, description="DDP: allow parameters that get no gradient in some steps (slower)."
    )


class RunConfig(Section):
    """One training run."""

    name: str = Field("run", description="Names the run dir: `<runs_root>/<name>-<timestamp>`.")
    seed: int = Field(0, description="Seeds Python, NumPy, torch, shuffling and workers.")
    model: ComponentSpec | None = Field(None, description="The model to train.")
    data: DataConfig = DataConfig()
    loader: LoaderConfig = LoaderConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    distributed: DistributedConfig = DistributedConfig()
    callbacks: list[str | ComponentSpec] = Field(
        default_factory=list,
        description="Callbacks, each an import path `file.py:Class` (called with no "
        "arguments) or `{name: file.py:Class, args: {...}}`; run in this order.",
    )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (lists, not tuples), as written to `config.yaml` and checkpoints."""
        plain: dict[str, Any] = _plain(self.model_dump(mode="json"))
        return plain


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# --- validation with errors for people -------------------------------------------------


def validate_config(
    raw: Mapping[str, Any], *, source: str = "config", overrides: Sequence[str] = ()
) -> RunConfig:
    """Validate a raw mapping, reporting every problem at once with its field path.

    Args:
        raw: The config mapping, overrides applied.
        source: What the mapping came from (the config file), named in the message.
        overrides: The ``key=value`` overrides applied to it: a problem with a value one
            of them set is reported under that override, not under ``source``.
    """
    try:
        return RunConfig.model_validate(dict(raw))
    except ValidationError as exc:
        raise ConfigError(
            describe_problems(exc, root=RunConfig, source=source, overrides=overrides)
        ) from None


# --- loading and overrides -------------------------------------------------------------


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping, with errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config file not found: {path}",
            hint="check the path; the reference config is examples/digits.yaml",
        )
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def apply_overrides(
    raw: Mapping[str, Any], overrides: Sequence[str], *, base: Path | None = None
) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides; values are parsed as YAML, so types follow the schema.

    Args:
        raw: The config mapping to start from (not modified).
        overrides: Strings such as ``train.epochs=2`` or ``optim.betas=[0.9,0.95]``.
        base: When given, relative paths the overrides set resolve from this folder (the
            current one, for overrides typed on the command line).
    """
    result: dict[str, Any] = _deep_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(
                f"override {item!r} is not of the form key.sub=value",
                hint="for example: train.epochs=2 loader.batch_size=128",
            )
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        parts = key.strip().split(".")
        if base is not None:
            value = resolve_paths(value, at=tuple(parts), base=base)
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {item!r}: {where} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load, override and validate a run config file.

    Relative paths in the file (data files, ``models.py:Net``, a collate function, cache
    and run folders) resolve from the file's folder, whatever the current folder; those
    set by ``overrides`` resolve from the current folder. Both come out absolute (see
    :mod:`stoker.config_paths`).
    """
    folder = Path(path).absolute().parent
    raw = resolve_paths(load_yaml(path), at=(), base=folder)
    raw = apply_overrides(raw, overrides, base=Path.cwd())
    return validate_config(raw, source=str(path), overrides=overrides)


def write_config(config: RunConfig, path: str | Path) -> None:
    """Write the resolved config (every default filled in) as YAML."""
    # Through safe_files: a run dir's config.yaml that is a symlink is refused, not followed.
    from stoker.safe_files import write_text

    write_text(path, yaml.safe_dump(config.to_dict(), sort_keys=False))


# --- flat keyword options for stoker.fit -----------------------------------------------

#: Sections whose fields can be given to ``stoker.fit`` as flat keyword options.
_FLAT_SECTIONS = ("train", "loader", "optim", "schedule", "checkpoint", "tracking", "data")
#: The ``name`` fields get the word a user would say instead.
_NAME_ALIASES = {"optim": "optimizer", "schedule": "schedule", "loss": "loss"}


def _flat_option_paths() -> dict[str, tuple[str, str]]:
    paths: dict[str, tuple[str, str]] = {"seed": ("", "seed"), "name": ("", "name")}
    for section in (*_FLAT_SECTIONS, "loss"):
        model = RunConfig.model_fields[section].annotation
        assert isinstance(model, type) and issubclass(model, BaseModel)
        for field in model.model_fields:
            if section == "data" and field in ("train", "val", "test"):
                continue
            option = _NAME_ALIASES.get(section, field) if field == "name" else field
            if field == "args":  # loss_args, optimizer_args, schedule_args
                option = f"{_NAME_ALIASES[section]}_args"
            assert option not in paths, f"flat option {option!r} is ambiguous"
            paths[option] = (section, field)
    return paths


FLAT_OPTIONS: dict[str, tuple[str, str]] = _flat_option_paths()


def config_from_options(options: Mapping[str, Any]) -> RunConfig:
    """Build a RunConfig from ``stoker.fit``'s flat keyword options (``epochs=3, lr=1e-2``)."""
    raw: dict[str, Any] = {}
    unknown = []
    for option, value in options.items():
        if option not in FLAT_OPTIONS:
            unknown.append(f"  - {option}: unknown option{suggest(option, FLAT_OPTIONS)}")
            continue
        section, field = FLAT_OPTIONS[option]
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if section:
            raw.setdefault(section, {})[field] = value
        else:
            raw[field] = value
    if unknown:
        raise ConfigError(
            "stoker.fit got unknown options:\n" + "\n".join(unknown),
            hint="see `stoker.config.FLAT_OPTIONS` for every option and the config key it sets",
        )
    return validate_config(raw, source="stoker.fit options")
