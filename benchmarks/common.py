"""Shared pieces of the benchmarks: the seed workload, side-by-side timing, checks and JSON.

Every comparison runs its contenders in one process, alternating their order round
by round after a warm-up round that is thrown away, and reports medians and ratios
(DESIGN.md, principle 7: nothing is hard-coded or cached).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import platform
import statistics
import subprocess
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset

REPO = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------ the seed workload

SEED_ROWS = 10_000
SEED_FEATURES = 20


class CSVWindowDataset(Dataset):
    """The seed module's per-sample Dataset, verbatim: one numpy row per ``__getitem__``."""

    def __init__(self, n_rows: int = SEED_ROWS, n_features: int = SEED_FEATURES) -> None:
        rng = np.random.default_rng(42)
        self.X = rng.normal(size=(n_rows, n_features)).astype("float32")
        self.y = (self.X[:, 0] + self.X[:, 1] > 0).astype("int64")

    def __len__(self) -> int:
        return len(self.X)

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, Any]:
        return torch.from_numpy(self.X[idx]), self.y[idx]


def seed_model(seed: int = 0) -> nn.Module:
    """The seed's MLP 20→32→2, with weights fixed by ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(SEED_FEATURES, 32), nn.ReLU(), nn.Linear(32, 2))


class StepStamps:
    """Stamps ``perf_counter`` at every forward call of a model (a forward pre-hook).

    The same hook goes on every contender's model, so its cost (about a microsecond)
    is the same for all; the time between two forward calls of one epoch is one whole
    training step (fetch, forward, loss, backward, optimizer, bookkeeping).
    """

    def __init__(self, model: nn.Module, *, cpu: bool = False) -> None:
        self.stamps: list[float] = []
        #: With ``cpu``: this process's CPU time at each forward too (``cpu_span_s``),
        #: which other jobs on a shared machine disturb less than the wall clock.
        self.cpu_stamps: list[float] = []
        self._handle = model.register_forward_pre_hook(self._stamp_cpu if cpu else self._stamp)

    def _stamp(self, module: nn.Module, args: Any) -> None:
        self.stamps.append(time.perf_counter())

    def _stamp_cpu(self, module: nn.Module, args: Any) -> None:
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())

    def cpu_span_s(self) -> float:
        """CPU time from the first forward to the last, extrapolated by one step."""
        n = len(self.cpu_stamps)
        if n < 2:
            return float("nan")
        return (self.cpu_stamps[-1] - self.cpu_stamps[0]) * n / (n - 1)

    def remove(self) -> None:
        self._handle.remove()

    def step_times(self, steps_per_epoch: int, *, cpu: bool = False) -> list[float]:
        """Per-step times within each epoch (the epoch boundaries are left out); with
        ``cpu``, CPU times (needs ``cpu=True`` at construction)."""
        stamps = self.cpu_stamps if cpu else self.stamps
        times: list[float] = []
        for start in range(0, len(stamps), steps_per_epoch):
            epoch = stamps[start : start + steps_per_epoch]
            times.extend(b - a for a, b in itertools.pairwise(epoch))
        return times

    def span_s(self) -> float:
        """First forward to last forward, extrapolated by one step: the training time."""
        n = len(self.stamps)
        if n < 2:
            return float("nan")
        return (self.stamps[-1] - self.stamps[0]) * n / (n - 1)


def weights_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, Any]:
    equal = all(torch.equal(a[k], b[k]) for k in a)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    return {"bitwise_equal": equal, "max_abs_diff": diff}


class Timed:
    """A contender: builds a fresh model with the shared initial weights, stamps, runs."""

    def __init__(self, init: dict, steps_per_epoch: int, run: Callable[[nn.Module], Any]) -> None:
        self.init, self.steps_per_epoch, self.run = init, steps_per_epoch, run
        self.last_weights: dict[str, torch.Tensor] = {}

    def __call__(self) -> dict[str, Any]:
        model = seed_model()
        model.load_state_dict(self.init)
        stamps = StepStamps(model, cpu=True)
        started = time.perf_counter()
        extra = self.run(model)
        wall = time.perf_counter() - started
        stamps.remove()
        self.last_weights = weights_of(model)
        steps = stamps.step_times(self.steps_per_epoch)
        cpu_steps = stamps.step_times(self.steps_per_epoch, cpu=True)
        record = {
            "step_s": median(steps),
            "train_s": stamps.span_s(),
            "wall_s": wall,
            # This process's CPU time: less disturbed by other jobs on a shared machine.
            "cpu_step_s": median(cpu_steps),
            "cpu_train_s": stamps.cpu_span_s(),
        }
        record.update(extra if isinstance(extra, dict) else {"loss": extra})
        return record


def column(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


# ------------------------------------------------------------------ Lightning


def lightning_status() -> str:
    """Empty when Lightning can run here, else why its rows are left out ("not installed")."""
    try:
        import lightning  # noqa: F401
    except ImportError:
        return "not installed"
    quiet_lightning()
    return ""


def lightning_available() -> bool:
    return not lightning_status()


def quiet_lightning() -> None:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def lightning_fit(model: nn.Module, loader: Iterable, epochs: int, make_opt) -> float:
    """``Trainer.fit`` of ``model`` as a LightningModule whose step is the hand loop's body.

    A dict of inputs (a padded text batch) goes to the model as keyword arguments,
    as stoker and the hand loops pass it. No logger, checkpoints, progress bar, model
    summary or sanity check: Lightning's own loop and nothing else.
    """
    import lightning as L

    class Wrapped(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.loss_fn = nn.CrossEntropyLoss()
            self.last = torch.zeros(())

        def training_step(self, batch, batch_idx):
            xb, yb = batch
            out = self.model(**xb) if isinstance(xb, Mapping) else self.model(xb)
            loss = self.loss_fn(out, yb)
            self.last = loss.detach()
            return loss

        def configure_optimizers(self):
            return make_opt(self.model.parameters())

    wrapped = Wrapped()
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(wrapped, train_dataloaders=loader)
    return float(wrapped.last)


def lightning_version() -> str | None:
    try:
        import lightning
    except ImportError:
        return None
    return lightning.__version__


# ------------------------------------------------------------------ timing


def set_threads(threads: int) -> None:
    """Intra-op threads for this process (1 by default: see ``--threads`` in run_all)."""
    torch.set_num_threads(threads)


def interleaved(
    contenders: dict[str, Callable[[], Any]], *, rounds: int, warmup: int = 1
) -> dict[str, list[Any]]:
    """Run every contender once per round, alternating the order; drop the warm-up rounds."""
    names = list(contenders)
    results: dict[str, list[Any]] = {name: [] for name in names}
    for index in range(warmup + rounds):
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            value = contenders[name]()
            if index >= warmup:
                results[name].append(value)
    return results


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def paired_ratio(numerators: list[float], denominators: list[float]) -> float:
    """Median of the per-round ratios (each pair measured back to back)."""
    return median([a / b for a, b in zip(numerators, denominators, strict=True)])


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of a list (for the JSON)."""
    return {"median": median(values), "min": min(values), "max": max(values), "n": len(values)}


# ------------------------------------------------------------------ checks and JSON


@dataclass
class Check:
    """One figure of the summary table: its value, its target and the verdict.

    ``passed`` is None for a figure without a target (shown as ``info``) and for a
    contender that could not run (``status`` says why, e.g. ``not installed``).
    """

    benchmark: str
    figure: str
    value: float | None
    target: str = ""
    passed: bool | None = None
    unit: str = "x"
    status: str = ""
    note: str = ""

    def verdict(self) -> str:
        if self.status:
            return self.status
        if self.passed is None:
            return "info"
        return "pass" if self.passed else "FAIL"


def target_check(
    benchmark: str,
    figure: str,
    value: float,
    op: str,
    threshold: float,
    *,
    unit: str = "x",
    note: str = "",
) -> Check:
    """A figure with a target ``value op threshold`` (op: ``>=``, ``>``, ``<=`` or ``<``)."""
    compare = {
        ">=": value >= threshold,
        ">": value > threshold,
        "<=": value <= threshold,
        "<": value < threshold,
    }
    passed = compare[op]
    return Check(benchmark, figure, value, f"{op} {threshold:g}", bool(passed), unit, note=note)


def info(
    benchmark: str, figure: str, value: float | None, *, unit: str = "", note: str = ""
) -> Check:
    return Check(benchmark, figure, value, "", None, unit, note=note)


def format_value(check: Check) -> str:
    value = check.value
    if value is None or (isinstance(value, float) and value != value):
        return "-"
    if check.unit == "x":
        if abs(value) < 0.1:
            return f"{value:.2g}x"
        return f"{value:.3f}x" if abs(value) < 10 else f"{value:.1f}x"
    if check.unit == "%":
        return f"{value:.2f}%"
    if check.unit == "us":
        return f"{value:.1f} us"
    if check.unit == "samples/s":
        return f"{value / 1e6:.2f} M/s" if value >= 1e5 else f"{value:,.0f} /s"
    if check.unit in ("MiB", "MB"):
        return f"{value:.0f} {check.unit}"
    if check.unit == "s":
        return f"{value:.2f} s"
    return f"{value:.4g} {check.unit}".strip()


def table(checks: list[Check]) -> str:
    """The checks as a fixed-width table."""
    rows = [("benchmark", "figure", "value", "target", "result")]
    rows += [(c.benchmark, c.figure, format_value(c), c.target or "-", c.verdict()) for c in checks]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for index, row in enumerate(rows):
        cells = [cell.ljust(width) for cell, width in zip(row[:4], widths, strict=True)]
        lines.append("  ".join([*cells, row[4]]))
        if index == 0:
            lines.append("-" * len(lines[0]))
    return "\n".join(lines)


def git_revision() -> dict[str, Any]:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "src"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "src_dirty": None}
    return {"commit": commit, "src_dirty": bool(dirty)}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """Where and when the figures were measured."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "cores": cores,
        "gpu": gpu,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        **git_revision(),
    }


@dataclass
class Result:
    """What one benchmark writes: ``<out>/<benchmark>.json``."""

    benchmark: str
    timed: str
    workload: dict[str, Any]
    figures: dict[str, Any] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)

    def write(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": self.benchmark,
            "machine": machine(),
            "timed": self.timed,
            "workload": self.workload,
            "figures": self.figures,
            "checks": [asdict(c) for c in self.checks],
        }
        path = out / f"{self.benchmark}.json"
        path.write_text(json.dumps(payload, indent=2, default=_jsonable) + "\n")
        return path


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def add_common_arguments(parser: Any) -> None:
    parser.add_argument("--out", type=Path, required=True, help="folder for <benchmark>.json")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: on a small shared machine a second "
        "thread only adds OpenMP barrier stalls to these tiny kernels)",
    )
    parser.add_argument("--rounds", type=int, default=None, help="measured rounds (after warm-up)")


class BusySamples(Dataset):
    """An input-heavy dataset: every sample burns ``work`` iterations of pure Python, so
    each loader process keeps one core busy (the tuner benchmark and the GPU check)."""

    def __init__(self, n: int = 8192, features: int = 16, work: int = 3000) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=generator)
        self.y = (self.x[:, 0] > 0).long()
        self.work = work

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        acc = index
        for k in range(self.work):
            acc = (acc * 31 + k) % 1_000_003
        return self.x[index], self.y[index]
