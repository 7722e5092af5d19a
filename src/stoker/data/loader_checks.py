"""Checks of build_loader's options: every problem found, reported together with its fix."""

from __future__ import annotations

import logging
from typing import Any, Literal, NamedTuple

import torch
from torch.utils.data import Dataset, IterableDataset

from stoker.data.sources import dataset_targets, innermost
from stoker.errors import ConfigError

__all__ = [
    "Problem",
    "SamplerName",
    "option_problems",
    "raise_all",
    "resolve_pin_memory",
    "resolve_sampler",
]

logger = logging.getLogger("stoker")

SamplerName = Literal["auto", "sequential", "random", "weighted", "bucket"]
_SAMPLERS = ("auto", "sequential", "random", "weighted", "bucket")


class Problem(NamedTuple):
    """One invalid or conflicting option: what is wrong, and the fix."""

    message: str
    fix: str


def _int_problem(name: str, value: Any, minimum: int) -> Problem | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return Problem(
            f"loader.{name} must be an int >= {minimum}; got {value!r}.",
            f"set loader.{name} to an int >= {minimum}",
        )
    return None


def _seconds_problem(name: str, value: Any) -> Problem | None:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not value >= 0 or value == float("inf"):
        return Problem(
            f"loader.{name} must be a number of seconds >= 0 (0: no limit); got {value!r}.",
            f"set loader.{name} to a number of seconds, e.g. 300",
        )
    return None


def option_problems(
    *,
    batch_size: Any,
    num_workers: Any,
    num_samples: Any,
    prefetch_factor: Any,
    persistent_workers: bool,
    pin_memory: Any,
    sampler: Any,
    timeout_s: Any = 0.0,
) -> list[Problem]:
    """Problems with the options that do not depend on the dataset."""
    checks = [
        _int_problem("batch_size", batch_size, 1),
        _int_problem("num_workers", num_workers, 0),
        None if num_samples is None else _int_problem("num_samples", num_samples, 1),
        None if prefetch_factor is None else _int_problem("prefetch_factor", prefetch_factor, 1),
        _seconds_problem("timeout_s", timeout_s),
    ]
    no_workers = not isinstance(num_workers, int) or num_workers <= 0
    rules = [
        (
            prefetch_factor is not None and no_workers,
            f"loader.prefetch_factor={prefetch_factor} only applies to worker processes, "
            f"but loader.num_workers={num_workers}.",
            "set loader.num_workers>0 or drop loader.prefetch_factor",
        ),
        (
            persistent_workers and no_workers,
            "loader.persistent_workers=true keeps worker processes alive, "
            f"but loader.num_workers={num_workers}.",
            "set loader.num_workers>0 or set loader.persistent_workers=false",
        ),
        (
            pin_memory != "auto" and not isinstance(pin_memory, bool),
            f"loader.pin_memory={pin_memory!r}; expected true, false or auto.",
            "set loader.pin_memory=auto",
        ),
        (
            sampler not in _SAMPLERS,
            f"loader.sampler={sampler!r}; expected one of {', '.join(_SAMPLERS)}.",
            "set loader.sampler=auto",
        ),
    ]
    problems = [p for p in checks if p is not None]
    return problems + [Problem(message, fix) for bad, message, fix in rules if bad]


def resolve_sampler(
    sampler: str,
    *,
    shuffle: bool,
    weights: Any,
    num_samples: int | None,
    dataset: Dataset,
    problems: list[Problem],
) -> str:
    """The sampler ``auto`` stands for; adds problems for contradicting options."""
    streaming = isinstance(dataset, IterableDataset)
    if streaming:
        resolved = "sequential"
    elif sampler == "auto":
        # Weighted draws are random, so weights satisfy shuffle=true as well.
        resolved = "weighted" if weights is not None else "random" if shuffle else "sequential"
    else:
        resolved = sampler
    reorders = shuffle or sampler in ("random", "weighted") or weights is not None
    what = (
        "loader.shuffle=true" if shuffle
        else "loader.weights" if weights is not None
        else f"loader.sampler={sampler}"
    )  # fmt: skip
    rules = [
        (
            not streaming and sampler == "bucket" and weights is not None,
            "loader.sampler=bucket groups samples by length and does not use loader.weights.",
            "drop loader.weights, or use loader.sampler=weighted without bucketing",
        ),
        (
            streaming and reorders,
            f"{what} cannot reorder {type(dataset).__name__}: it is an IterableDataset "
            "(a stream) that decides its own order.",
            "shuffle or resample inside the stream (e.g. a shuffle buffer), and set "
            "loader.shuffle=false, loader.sampler=auto and no loader.weights",
        ),
        (
            not streaming and shuffle and sampler == "sequential",
            "loader.shuffle=true conflicts with loader.sampler=sequential, which reads in order.",
            "set loader.shuffle=false, or set loader.sampler=random (or auto)",
        ),
        (
            not streaming and sampler == "weighted" and weights is None,
            "loader.sampler=weighted needs per-sample weights, but loader.weights is unset.",
            _weights_fix(dataset) if sampler == "weighted" and weights is None else "",
        ),
        (
            streaming and sampler == "bucket",
            f"loader.sampler=bucket cannot group {type(dataset).__name__} by length: it is "
            "an IterableDataset (a stream), read in its own order.",
            "set loader.sampler=auto (or give a map-style dataset with lengths() to bucket)",
        ),
        (
            not streaming and sampler in ("sequential", "random") and weights is not None,
            f"loader.weights is set, but loader.sampler={sampler} does not use weights.",
            "set loader.sampler=weighted (or auto), or drop loader.weights",
        ),
        (
            resolved != "weighted" and num_samples is not None,
            f"loader.num_samples={num_samples} is only used by the weighted sampler, "
            f"but the sampler is {resolved}.",
            "drop loader.num_samples, or set loader.weights",
        ),
    ]
    problems.extend(Problem(message, fix) for bad, message, fix in rules if bad)
    return resolved


def _weights_fix(dataset: Dataset) -> str:
    """The fix for a weighted sampler without weights: ``balanced`` only if labels are known."""
    if dataset_targets(dataset) is not None:
        return "set loader.weights=balanced for class balancing, or give one weight per sample"
    inner, _, name = innermost(dataset)
    if type(inner).__module__.startswith("stoker."):
        return (
            f"set loader.weights to one weight per sample ({name} does not hold its labels "
            "apart from the samples, so weights=balanced cannot be used)"
        )
    return (
        f"set loader.weights to one weight per sample, or give {type(inner).__name__} a "
        "`targets` attribute (one class id per sample) and set loader.weights=balanced"
    )


def raise_all(problems: list[Problem]) -> None:
    """Raise one ConfigError that lists every problem found."""
    if len(problems) == 1:
        raise ConfigError(problems[0][0], hint=problems[0][1])
    if problems:
        message = "invalid loader options:\n" + "\n".join(f"  - {m}" for m, _ in problems)
        raise ConfigError(message, hint="; ".join(h for _, h in problems))


def resolve_pin_memory(pin_memory: bool | str, device: str | torch.device | None) -> bool:
    """``loader.pin_memory`` as a bool: ``auto`` pins for CUDA only; ``true`` without CUDA warns."""
    device_type = None
    if device is not None and str(device) != "auto":
        try:
            device_type = torch.device(device).type
        except (RuntimeError, ValueError) as error:
            raise ConfigError(
                f"device={device!r} is not a device; expected auto, cpu, cuda, cuda:N or mps.",
                hint="set train.device=auto",
            ) from error
    cuda = torch.cuda.is_available()
    if pin_memory == "auto":
        return cuda and device_type in (None, "cuda")
    if pin_memory and not cuda:
        logger.warning(
            "loader.pin_memory=true but CUDA is not available; loading without pinned "
            "memory (set loader.pin_memory=auto to silence this)"
        )
        return False
    return bool(pin_memory)
