"""Use a trained run: rebuild its model with the best or last weights, evaluate, predict.

A run dir holds everything needed: ``config.yaml`` (the resolved config, paths absolute)
rebuilds the model, the data pipeline and the loss; ``checkpoints/`` (``best.json``,
``last.json``) and ``model.safetensors`` hold the weights. Checkpoints are verified
(SHA-256) and loaded with ``weights_only=True``, as a resume loads them.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset

from stoker import components
from stoker.checkpoint import load_checkpoint, load_safetensors_into
from stoker.checkpoint.layout import checkpoints_dir, find_latest_valid, read_pointer
from stoker.checkpoint.manifest import inspect_checkpoint
from stoker.config import ComponentSpec, RunConfig, load_config
from stoker.data.device import move_to_device, resolve_device
from stoker.data.loader import build_loader
from stoker.data.sources import length_or_none
from stoker.errors import CheckpointError, ConfigError, DataError
from stoker.predictions import PredictionWriter, open_writer
from stoker.safe_files import write_text
from stoker.train.batch import forward
from stoker.train.evaluate import evaluate
from stoker.train.metric_set import build_metrics
from stoker.train.objective import UserStep, evaluate_steps
from stoker.train.precision import build_precision

__all__ = ["Weights", "evaluate_run", "find_weights", "load_model", "load_run_config", "predict"]

Which = Literal["best", "last"]
#: The argument of a data spec that names its file or folder, for ``--data`` and INPUT
#: (the names ``stoker.config_paths`` resolves as paths, less the ``*_dir`` kind, which
#: may be a cache's).
PATH_ARGS = ("path", "paths", "root", "dir", "file", "folder")
#: What ``stoker predict`` reads for a run whose data spec names no file (a built-in
#: dataset such as ``digits``, a function): a plain file of the model's inputs, one row
#: per sample, by its suffix, with the source that reads that kind of file in training.
PLAIN_INPUTS = {".npy": "npy", ".csv": "csv", ".parquet": "parquet"}
SAFETENSORS = "model.safetensors"


@dataclass(frozen=True)
class Weights:
    """Where a run's weights are read from.

    Attributes:
        path: A checkpoint folder, or the run's ``model.safetensors``.
        which: ``best`` or ``last``.
        epoch: The epoch the checkpoint was saved in (from 1), None for safetensors.
        step: The optimizer step it was saved at, None for safetensors.
    """

    path: Path
    which: Which
    epoch: int | None = None
    step: int | None = None

    def describe(self) -> str:
        """One line saying which weights were loaded, from where, and their epoch and step."""
        where = f" (epoch {self.epoch}, step {self.step})" if self.step is not None else ""
        return f"{self.which} weights: {self.path}{where}"


def load_run_config(run_dir: str | Path) -> RunConfig:
    """The resolved config a run wrote to ``RUN_DIR/config.yaml``."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(
            f"{run_dir} is not a run dir: it has no config.yaml",
            hint="give the folder a run printed as its run dir (runs/<name>-<timestamp>)",
        )
    return load_config(path)


def find_weights(run_dir: str | Path, which: Which = "best") -> Weights:
    """The checkpoint (or ``model.safetensors``) holding a run's ``best`` or ``last`` weights.

    ``last`` is the newest checkpoint that verifies (a run stopped and resumed continues
    from it too), or ``model.safetensors`` for a run without checkpoints. ``best`` is the
    checkpoint ``checkpoints/best.json`` names: the best value of ``train.monitor``.

    Raises:
        CheckpointError: The run has no such weights; the hint says which it has.
    """
    if which not in ("best", "last"):
        raise ConfigError(f"which={which!r}: expected 'best' or 'last'", hint="--which best")
    run_dir = Path(run_dir)
    directory = checkpoints_dir(run_dir)
    if which == "best":
        folder = read_pointer(directory, "best") if directory.is_dir() else None
    else:
        folder, damaged = find_latest_valid(directory) if directory.is_dir() else (None, [])
        if folder is None and damaged:
            raise CheckpointError(
                f"every checkpoint in {directory} is damaged; the newest: {damaged[0][1]}",
                hint="restore the checkpoints from a copy",
            )
    if folder is not None:
        info = inspect_checkpoint(folder, hash_files=False)
        return Weights(folder, which, epoch=info.epoch, step=info.step)
    exported = run_dir / SAFETENSORS
    if which == "last" and exported.is_file():
        return Weights(exported, which)
    has = "model.safetensors (the last weights)" if exported.is_file() else "no weights"
    if which == "best":
        raise CheckpointError(
            f"{run_dir} has no best checkpoint (checkpoints/best.json); it has {has}",
            hint="use which='last' (--which last); a run keeps its best checkpoint unless "
            "checkpoint.keep_best or checkpoint.enabled is false",
        )
    raise CheckpointError(
        f"{run_dir} has no weights: no checkpoint and no {SAFETENSORS}",
        hint="train the run (or resume it) until it saves a checkpoint",
    )


def load_model(
    run_dir: str | Path,
    *,
    which: Which = "best",
    model: nn.Module | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Rebuild a run's model from its ``config.yaml`` and load its best or last weights.

    Args:
        run_dir: The run dir a run printed (``runs/<name>-<timestamp>``).
        which: ``best`` (by ``train.monitor``) or ``last`` (see :func:`find_weights`).
        model: The model to fill, for a run whose model was passed to ``stoker.fit`` as a
            Python object (its config cannot rebuild it); it must be the same architecture.
        device: Where to put the model; ``auto`` picks CUDA when there is one.

    Returns:
        The model with the weights loaded, in eval mode.

    Raises:
        ConfigError: The run dir has no config, or its model cannot be rebuilt.
        CheckpointError: The weights are missing, damaged or do not fit the model.
    """
    return _load(load_run_config(run_dir), run_dir, which=which, model=model, device=device)[0]


def _load(
    config: RunConfig,
    run_dir: str | Path,
    *,
    which: Which,
    model: nn.Module | None = None,
    device: str | torch.device,
) -> tuple[nn.Module, Weights]:
    weights = find_weights(run_dir, which)
    if model is None:
        if config.model is None:
            raise ConfigError(
                f"the run in {run_dir} trained a model given to stoker.fit in Python, which "
                "its config.yaml cannot rebuild",
                hint="build the same model and pass it: load_model(run_dir, model=MyNet(...))",
            )
        model = components.build_model(config)
    _load_weights(model, weights)
    return model.to(resolve_device(str(device))).eval(), weights


def _load_weights(model: nn.Module, weights: Weights) -> None:
    if weights.path.name == SAFETENSORS:
        load_safetensors_into(model, weights.path)
        return
    bundle = load_checkpoint(weights.path)  # hashes every file, then weights_only=True
    try:
        model.load_state_dict(bundle["model"])
    except RuntimeError as exc:
        raise CheckpointError(
            f"the weights in {weights.path} do not fit {type(model).__name__}: {exc}",
            hint="rebuild the model with the arguments the run trained it with",
        ) from exc


def evaluate_run(
    run_dir: str | Path,
    *,
    data: str | Path | None = None,
    which: Which = "best",
    device: str | None = None,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Evaluate a run's best or last weights: loss, the task's metrics and ``train.metrics``.

    The metrics are computed by the same code as validation during training
    (``stoker.train.evaluate``), under ``torch.inference_mode``; a run with a
    ``train.step_fn`` is measured by its ``eval_fn`` (or ``step_fn``), as it validated.

    Args:
        run_dir: The run dir.
        data: A file or folder in the form of the run's data (its data spec's path
            argument is replaced by it); None evaluates the run's validation data.
        which: ``best`` or ``last``.
        device: ``cpu``, ``cuda``, ``auto``…; default: the run's ``train.device``.
        batch_size: Default: the run's ``loader.val_batch_size`` or ``loader.batch_size``.

    Returns:
        ``{"metrics": {"eval/loss": …, "eval/accuracy": …}, "samples": …, "data": …,
        "weights": …, "which": …, "epoch": …, "step": …}``.
    """
    config = load_run_config(run_dir)
    dataset = dataset_for(config, data) if data is not None else _validation_data(config, run_dir)
    device_ = resolve_device(device or config.train.device)
    model, weights = _load(config, run_dir, which=which, device=device_)
    loader = _loader(config, dataset, device=device_, batch_size=batch_size)
    ignore = config.loss.ignore_index if config.loss.normalize == "tokens" else None
    precision = build_precision(config.train, device_)
    step_fn, eval_fn = components.build_step_fns(config)
    own = eval_fn or step_fn
    if own is not None:
        # As the run validated: its eval_fn (or step_fn) gives the loss and its figures.
        field = "eval_fn" if eval_fn is not None else "step_fn"
        step = UserStep(own, field=f"train.{field}")
        metrics = evaluate_steps(
            model, loader, step, device=device_, precision=precision, prefix="eval"
        )
    else:
        metrics = evaluate(
            model,
            loader,
            components.build_loss(config),
            device=device_,
            precision=precision,
            task=components.task_of(config),
            prefix="eval",
            ignore_index=ignore,
            metrics=build_metrics(config.train.metrics),
        )
    return {
        "metrics": metrics,
        "samples": length_or_none(dataset),
        "data": str(Path(data).absolute()) if data is not None else "validation data",
        "which": which,
        "weights": str(weights.path),
        "epoch": weights.epoch,
        "step": weights.step,
    }


def predict(
    run_dir: str | Path,
    data: str | Path,
    *,
    out: str | Path,
    which: Which = "best",
    device: str | None = None,
    batch_size: int | None = None,
    progress: bool = True,
) -> tuple[Path, int]:
    """Write a run's predictions for ``data`` to ``out``, batch by batch.

    The file type follows ``out``'s suffix. ``.parquet`` and ``.csv`` hold one row per
    input sample: ``index``; for classification ``prediction`` (the class index),
    ``probability`` (its softmax or sigmoid) and ``label`` (the class name, when the data
    names its classes); for regression ``prediction`` (``prediction_0``… for several
    outputs); and ``target`` when the data has one. ``.npy`` holds the model's raw outputs
    (logits for classification), one row per sample. The file appears whole or not at all.

    Args:
        run_dir: The run dir.
        data: A file or folder in the form of the run's data (see :func:`evaluate_run`).
        out: The file to write: ``.parquet``, ``.csv`` or ``.npy``.
        which: ``best`` or ``last``.
        device: Default: the run's ``train.device``.
        batch_size: Default: the run's ``loader.val_batch_size`` or ``loader.batch_size``.
        progress: Show a progress bar (on a terminal).

    Returns:
        The file written and the number of predictions (rows) in it.
    """
    config = load_run_config(run_dir)
    writer_type = open_writer(out)  # an unknown suffix fails before any work
    dataset = dataset_for(config, data, inputs_only=True)
    device_ = resolve_device(device or config.train.device)
    model = _load(config, run_dir, which=which, device=device_)[0]
    precision = build_precision(config.train, device_)
    loader = _loader(config, dataset, device=device_, batch_size=batch_size)
    classes = getattr(dataset, "classes", None)
    writer: PredictionWriter = writer_type(
        Path(out), task=components.task_of(config), classes=classes, rows=length_or_none(dataset)
    )
    with writer, torch.inference_mode():
        for batch in _with_bar(loader, show=progress, what=f"predicting {Path(data).name}"):
            inputs, targets = _inputs_and_targets(move_to_device(batch, device_))
            with precision.autocast():
                outputs = forward(model, inputs)
            writer.write(outputs, targets)
    return writer.path, writer.rows


def dataset_for(config: RunConfig, path: str | Path, *, inputs_only: bool = False) -> Dataset[Any]:
    """The run's data spec read from ``path`` instead of the run's own file or folder.

    The validation spec (``data.val``) is the template when the run has one, else
    ``data.train``; its path argument (``path``, ``root``, ``dir``…) is replaced by
    ``path``, and random augmentation (``augment``) is turned off. With
    ``inputs_only`` (predictions need no targets), a run whose data spec names no file
    — a built-in dataset such as ``digits``, or a function — reads a plain ``.npy``,
    ``.csv`` or ``.parquet`` file of the model's inputs instead, one row per sample.
    """
    template = config.data.val or config.data.train
    if template is None:
        raise ConfigError("the run's config has no data spec (data.train) to read data with")
    target = Path(path).expanduser().absolute()
    key = next((k for k in PATH_ARGS if k in template.args), None)
    if key is None and not inputs_only:
        raise ConfigError(
            f"the run's data spec {template.name} has no path argument "
            f"({', '.join(PATH_ARGS)}), so stoker cannot point it at {path}",
            hint="load the model with stoker.load_model(run_dir) and run it on your data",
        )
    if key is None and PLAIN_INPUTS.get(target.suffix.lower()) is None:
        raise ConfigError(
            f"the run's data spec {template.name} reads no file, so stoker predicts from a "
            f"plain file of the model's inputs, one row per sample: .npy, .csv or .parquet, "
            f"not {path}",
            hint="save the inputs with numpy.save('inputs.npy', array), or load the model "
            "with stoker.load_model(run_dir) and run it on your data",
        )
    if not target.exists():
        raise DataError(f"{target} does not exist", hint="give a file or folder of data")
    if key is None:
        # Every column (every value of a .npy row) is an input: no target, no label.
        spec = ComponentSpec(name=PLAIN_INPUTS[target.suffix.lower()], args={"path": str(target)})
    else:
        args = {**template.args, key: str(target)}
        if "augment" in args:
            args["augment"] = False
        if inputs_only and args.get("target") and not _has_column(target, args):
            # A table of inputs alone: predictions need no target column.
            args = {k: v for k, v in args.items() if k not in ("target", "target_dtype")}
        spec = ComponentSpec(name=template.name, args=args)
    # The whole file, one sample per row: no validation or test share split off.
    data = config.data.model_copy(
        update={"train": spec, "val": None, "val_fraction": None, "test": None}
        | {"test_fraction": None}
    )
    return components.build_datasets(config.model_copy(update={"data": data}))[0]


def _has_column(path: Path, args: dict[str, Any]) -> bool:
    """Whether the CSV or Parquet table at ``path`` has the column ``args["target"]``
    (True when it cannot tell: the source then says what is wrong)."""
    name = args["target"]
    if path.is_dir():
        path = next(iter(sorted(path.glob("*.parquet"))), path)
    if not path.is_file():
        return True
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return name in pq.read_schema(path).names
    with path.open(newline="") as file:
        header = next(csv.reader(file, delimiter=args.get("delimiter", ",")), [])
    return name in header


def _validation_data(config: RunConfig, run_dir: str | Path) -> Dataset[Any]:
    """The run's own validation data: data.val, or the same val_fraction split of train."""
    if config.data.val is None and config.data.val_fraction is None:
        raise ConfigError(
            f"the run in {run_dir} has no validation data (data.val or data.val_fraction)",
            hint="pass the data to evaluate on: --data PATH (evaluate_run(..., data=PATH))",
        )
    val = components.build_datasets(config)[1]
    assert val is not None
    return val


def _loader(
    config: RunConfig, dataset: Dataset[Any], *, device: torch.device, batch_size: int | None
) -> Iterable[Any]:
    loader = config.loader
    return build_loader(
        dataset,
        batch_size=batch_size or loader.val_batch_size or loader.batch_size,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        persistent_workers=False,  # one pass
        prefetch_factor=loader.prefetch_factor,
        collate_fn=components.build_collate_fn(config),
        seed=config.seed,
        device=device,
        timeout_s=loader.timeout_s,
        split_across_ranks=False,
    )


def _inputs_and_targets(batch: Any) -> tuple[Any, Any]:
    """``(inputs, targets)``; targets None for data without them (a tensor of inputs)."""
    if isinstance(batch, (tuple, list)):
        return (batch[0], batch[1]) if len(batch) >= 2 else (batch[0], None)
    if isinstance(batch, dict) and "inputs" in batch:
        return batch["inputs"], batch.get("targets")
    return batch, None


def _with_bar(loader: Iterable[Any], *, show: bool, what: str) -> Iterator[Any]:
    """The loader's batches, with a rich bar on a terminal (nothing in a log or a pipe)."""
    if not show or not sys.stderr.isatty():
        yield from loader
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    total = length_or_none(loader)
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, transient=True, console=_stderr_console()) as bar:
        task = bar.add_task(what, total=total)
        for batch in loader:
            yield batch
            bar.advance(task)


def _stderr_console() -> Any:
    from rich.console import Console

    return Console(file=sys.stderr)


def write_evaluation(result: dict[str, Any], path: str | Path) -> Path:
    """Write :func:`evaluate_run`'s result as JSON (non-finite numbers as null)."""
    path = Path(path)
    # Atomic, and never through a link: the default place is inside the run dir.
    write_text(path, json.dumps(_finite(result), indent=2) + "\n")
    return path


def _finite(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
