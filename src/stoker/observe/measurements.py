"""The doctor's value objects: every figure it measured, a proposed change, the diagnosis."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from stoker.observe.fetch_cost import FetchFigures
from stoker.observe.short_run import PipelineFigures
from stoker.observe.stages import LoaderPoint, TransferFigures

__all__ = ["Change", "Diagnosis", "Measurements", "StageFigure", "Verdict"]

Verdict = Literal[
    "input-bound",
    "partly input-bound",
    "loader-overhead",
    "collate-bound",
    "oversubscribed",
    "transfer-bound",
    "threads-oversubscribed",
    "optimizer-bound",
    "balanced",
    "compute-bound",
]
Stage = Literal["loader", "transfer", "compute"]


@dataclass(frozen=True)
class Measurements:
    """Every figure the verdict is drawn from; rates are samples per second.

    Attributes:
        device: The training device (``cpu``, ``cuda``, ...).
        cores: CPU cores this process may use.
        torch_threads: ``torch.get_num_threads()`` of the training process.
        batch_size: ``loader.batch_size``.
        num_workers: ``loader.num_workers`` as the loader runs it (0 for in-memory
            arrays, which it serves in-process whatever the config says).
        pin_memory: Whether the configured loader pins batches.
        returns_batches: Whether the loader fetches whole batches (``__getitems__``).
        seconds: Time per measurement.
        loader: The loader alone at each measured worker count.
        compute_samples_per_s: Forward + backward + optimizer step on a batch on the device.
        pipeline: The short real training run.
        transfer: Host-to-device copies; None without an accelerator.
        fetch: Per-sample fetch costs; None for a stream.
        compute_repeats: The compute rate of each repeat.
        machine_load: The 1-minute load average before measuring (other processes).
        compute_shares: Forward (with the loss), backward and optimizer shares of a
            compute step, measured alone.
        optimizer: ``optim.name``; ``fused``: whether its fused kernel is in use.
        fused_samples_per_s: Compute alone with ``optim.fused=true`` (measured when the
            optimizer is not fused and takes a large share of the step).
        thread_rates: Compute alone at other intra-op thread counts (``{threads: rate}``).
        dataset_length: Samples in the training data (None for a stream).
        epochs: ``train.epochs`` (what a cache's first-epoch cost is spread over).
        cache: ``data.cache``.
        persistent_workers: ``loader.persistent_workers``.
    """

    device: str
    cores: int
    torch_threads: int
    batch_size: int
    num_workers: int
    pin_memory: bool
    returns_batches: bool
    seconds: float
    loader: tuple[LoaderPoint, ...]
    compute_samples_per_s: float
    pipeline: PipelineFigures
    transfer: TransferFigures | None = None
    fetch: FetchFigures | None = None
    compute_repeats: tuple[float, ...] = ()
    machine_load: float | None = None
    compute_shares: tuple[float, float, float] | None = None
    optimizer: str = "adamw"
    fused: bool = True
    fused_samples_per_s: float | None = None
    thread_rates: dict[int, float] = field(default_factory=dict)
    dataset_length: int | None = None
    epochs: int = 1
    cache: str = "none"
    persistent_workers: bool = False

    def loader_rate(self, num_workers: int) -> float:
        """The loader-alone rate at ``num_workers`` (0.0 when not measured)."""
        for point in self.loader:
            if point.num_workers == num_workers:
                return point.samples_per_s
        return 0.0

    @property
    def configured_loader_rate(self) -> float:
        """The loader's measured samples/s at the configured number of workers."""
        return self.loader_rate(self.num_workers)

    @property
    def optimizer_share(self) -> float:
        """The optimizer's share of a compute step (0 when not measured)."""
        return self.compute_shares[2] if self.compute_shares else 0.0


@dataclass(frozen=True)
class StageFigure:
    """One row of the doctor's table."""

    stage: str
    samples_per_s: float | None
    vs_pipeline: float | None
    note: str = ""


@dataclass(frozen=True)
class Change:
    """A change of settings the doctor proposes, and what it is expected to win.

    Attributes:
        settings: Dotted keys and values (``{"loader.num_workers": 8}``); what a user
            passes as ``KEY=VALUE`` overrides.
        why: The measured figures behind it, in words.
        predicted_gain: The pipeline's speed-up the stage ceilings predict.
        confirmed_gain: The speed-up a short run of the whole pipeline with the change
            applied showed (None until confirmed).
        cost: What it costs besides (a cache's first epoch).
    """

    settings: dict[str, Any]
    why: str
    predicted_gain: float
    confirmed_gain: float | None = None
    cost: str = ""

    def label(self) -> str:
        """The settings as ``key=value`` words, as a user types them as overrides."""
        return " ".join(f"{key}={_value(value)}" for key, value in self.settings.items())


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


@dataclass(frozen=True)
class Diagnosis:
    """The doctor's answer: what limits the pipeline, and what to change.

    Attributes:
        verdict: The bottleneck's name (see :data:`Verdict`).
        bottleneck: The stage that sets the pace: ``loader``, ``transfer`` or ``compute``.
        reason: The measured figures behind the verdict, in one sentence.
        recommendation: What to change, in words.
        recommended_loader: ``loader.*`` settings to apply (may be empty).
        expected_gain: Pipeline speed-up expected from the recommended change: measured
            by a short run with it applied once confirmed, else the stage ceilings'.
        gain_measured: Whether ``expected_gain`` was measured (False: an upper bound,
            such as the compute ceiling when loading became free).
        stages: The table rows.
        measurements: Every figure measured.
        warnings: Caveats about the measurements (e.g. unstable on a busy machine).
        settings: Every setting recommended, as dotted keys (``loader.num_workers``,
            ``optim.fused``, ``train.threads``, ``data.cache``).
        changes: Every change proposed, with its predicted and confirmed gain.
        code_advice: Changes to the user's code that no setting makes (batched fetch,
            a vectorised collate), with what they can win at most.
        confirmed: Whether the proposals were tried in short runs of the pipeline.
    """

    verdict: Verdict
    bottleneck: Stage
    reason: str
    recommendation: str
    recommended_loader: dict[str, Any]
    expected_gain: float | None
    gain_measured: bool
    stages: tuple[StageFigure, ...]
    measurements: Measurements
    warnings: tuple[str, ...] = field(default_factory=tuple)
    settings: dict[str, Any] = field(default_factory=dict)
    changes: tuple[Change, ...] = ()
    code_advice: tuple[str, ...] = ()
    confirmed: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready data (infinite or missing rates become null), ``verdict`` first."""
        return json_ready(dataclasses.asdict(self))


def json_ready(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
