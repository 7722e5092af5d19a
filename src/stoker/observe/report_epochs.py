"""The report's epoch figures — epochs done, the best epoch, early stopping — as the run
counted them (epochs from 1, the monitor's own choice)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stoker.observe.report_charts import epoch_label, finite, format_number

__all__ = ["best_label", "epochs_done_label", "read_training"]

Record = Mapping[str, Any]


def read_training(path: Path) -> dict[str, Any] | None:
    """``summary.json``'s ``training`` part (the loop's own count), None when not there.

    A run that has not finished has no summary yet; the report's summary section says
    what is wrong with a file that cannot be read.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, json.JSONDecodeError):
        return None
    training = data.get("training") if isinstance(data, dict) else None
    return training if isinstance(training, dict) else None


def epochs_done_label(
    train: Mapping[str, Any], epochs: Sequence[Record], training: Mapping[str, Any] | None
) -> str:
    """``3 of 10``, and why the run ended early when early stopping ended it."""
    planned = train.get("epochs")
    done = f"{len(epochs)} of {planned}" if isinstance(planned, int) else str(len(epochs))
    if training is not None and training.get("stopped_early") is True:
        done += f" (stopped early: {training.get('monitor')} stopped improving)"
    return done


def best_label(
    train: Mapping[str, Any], epochs: Sequence[Record], training: Mapping[str, Any] | None
) -> tuple[str, str]:
    """The monitored metric and its best epoch: the loop's own choice from ``summary.json``
    when the run finished; else chosen again as the loop chooses (the first best, beyond
    ``min_delta``), so that the report never names another epoch than the run did."""
    if training is not None and isinstance(training.get("monitor"), str):
        metric = f"{training['monitor']} ({training.get('mode')})"
        value, epoch = finite(training.get("best_value")), training.get("best_epoch")
        if value is None or not isinstance(epoch, int):
            return metric, "not recorded"
        record = next((r for r in epochs if r.get("epoch") == epoch), {"epoch": epoch})
        return metric, f"{format_number(value)} at {_where(record)}"
    has_val = any(key.startswith("val/") for r in epochs for key in r)
    name = train.get("monitor") or ("val/loss" if has_val else "train/loss")
    mode = train.get("monitor_mode") or "auto"
    if mode == "auto":
        mode = "max" if "accuracy" in str(name) else "min"
    stopping = train.get("early_stopping")
    min_delta = finite(stopping.get("min_delta")) if isinstance(stopping, dict) else None
    sign = 1.0 if mode == "max" else -1.0  # compared as "higher is better"
    best: tuple[float, Record] | None = None
    for record in epochs:
        value = finite(record.get(name))
        if value is not None and (best is None or sign * (value - best[0]) > (min_delta or 0.0)):
            best = (value, record)
    if best is None:
        return str(name), "not recorded"
    return f"{name} ({mode})", f"{format_number(best[0])} at {_where(best[1])}"


def _where(record: Record) -> str:
    step = finite(record.get("step"))
    return f"epoch {epoch_label(record)}" + (f", step {format_number(step)}" if step else "")
