"""Per-step phase timers: data wait, transfer, forward, backward, optimizer (and, in a
distributed run, the communication that fetching a batch waits in).

On the CPU a phase ends with a ``perf_counter`` read (tens of nanoseconds), and
``transfer`` is reported as 0: training on the CPU the batch is already where it is
used (``Loop.to_device`` passes it through), so the loop takes no stamp for it and
``lap("transfer")`` is a no-op there (``PhaseTimer.times_transfer`` is False). On CUDA
the host runs ahead of the device, so host clocks would time kernel *launches*;
there each phase boundary records a CUDA event instead, and the events are read
lazily — when ``summary`` is asked for, once per epoch — so timing adds no
synchronization to the step. Data wait is always a host time: it is the time the
training thread is blocked on the loader, less the time it spent in collectives
(``PhaseTimer.communication``), which is the ``communication`` phase.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

PHASES = ("data_wait", "transfer", "forward", "backward", "optimizer")
#: Reported only when a loader reported some (``PhaseTimer.communication``).
COMMUNICATION = "communication"
#: A step's row of durations, in the order the phases are shown.
_COLUMNS = (PHASES[0], COMMUNICATION, *PHASES[1:])
_INDEX = {phase: index for index, phase in enumerate(_COLUMNS)}
_DATA, _TALK = _INDEX["data_wait"], _INDEX[COMMUNICATION]


@dataclass(frozen=True)
class PhaseStats:
    """One phase over an epoch: total, median and p95 per step, share of step time."""

    total_s: float
    median_s: float
    p95_s: float
    share: float


class PhaseTimer:
    """Accumulates phase durations per step; summarizes them per epoch.

    Call ``start_step`` before fetching, ``data_ready`` when the batch arrived,
    ``lap(phase)`` at the end of each later phase (several times per step with
    gradient accumulation: laps add up), and ``end_step`` after the optimizer. A loader
    that waits in a collective while fetching calls ``communication(seconds)``.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        #: Whether ``lap("transfer")`` measures anything: on the CPU transfer is 0 (no copy).
        self.times_transfer = device.type != "cpu"
        # Host stamps per micro-batch: (transfer,) forward, backward.
        self._per_micro = 3 if self.times_transfer else 2
        # Decoded steps, one row of _COLUMNS each, in arrays of a few hundred rows.
        self._rows: list[np.ndarray] = []
        self._run_rows: list[np.ndarray] = []
        # CPU: one perf_counter stamp per boundary, a step's start stored negated; the
        # durations are worked out when read, so the step itself only appends floats.
        self._stamps: list[float] = []
        # CPU: (stamps so far, seconds) per communication call, for the step it falls in.
        self._talks: list[tuple[int, float]] = []
        self._pending: list[tuple[float, float, list[tuple[int, object, object]]]] = []
        self._events: list[tuple[int, object, object]] = []
        self._step_started = 0.0
        self._data_wait = 0.0
        self._talk_s = 0.0
        self._last_event: object | None = None
        if not self._cuda:
            self._use_cpu_calls()

    def _use_cpu_calls(self) -> None:
        """Replace the four calls by closures over the stamp list: on the CPU each call is
        then one clock read and one append, with no attribute lookups (measured: this is
        what keeps timing under 1% of a tiny model's step). ``lap("transfer")`` takes no
        stamp: on the CPU there is no transfer, and the loop does not call it."""
        append, clock = self._stamps.append, time.perf_counter

        def start_step() -> None:
            append(-clock())

        def data_ready() -> None:
            append(clock())

        def lap(phase: str) -> None:
            if phase != "transfer":
                append(clock())

        def stamp(phase: str) -> None:
            append(clock())

        self.start_step = start_step  # type: ignore[method-assign]
        self.data_ready = data_ready  # type: ignore[method-assign]
        self.lap = stamp if self.times_transfer else lap  # type: ignore[method-assign]
        self.end_step = _nothing  # type: ignore[method-assign]

    def start_step(self) -> None:
        if self._cuda:
            self._events = []
            self._talk_s = 0.0
            self._step_started = time.perf_counter()
        else:
            self._stamps.append(-time.perf_counter())

    def communication(self, seconds: float) -> None:
        """``seconds`` of this step's data fetch went waiting in a collective (the ranks
        agreeing that all have a batch): the communication phase, not data wait.

        Call it between ``start_step`` and ``data_ready``, once per collective or once
        with their sum; calls add up. Unlike the other calls it is not made in a
        single-process run, so it is an ordinary method.
        """
        if self._cuda:
            self._talk_s += seconds
        else:
            self._talks.append((len(self._stamps), seconds))

    def data_ready(self) -> None:
        if self._cuda:
            self._data_wait = time.perf_counter() - self._step_started
            self._last_event = _record_event()
        else:
            self._stamps.append(time.perf_counter())

    def lap(self, phase: str) -> None:
        """End ``phase``. On the CPU the order (forward, backward per micro-batch, then
        optimizer) is the loop's, so only the time is kept; transfer takes no stamp."""
        if self._cuda:
            event = _record_event()
            self._events.append((_INDEX[phase], self._last_event, event))
            self._last_event = event
        elif self.times_transfer or phase != "transfer":
            self._stamps.append(time.perf_counter())

    def end_step(self) -> None:
        if self._cuda:
            # Device times are read later, when the events have surely completed.
            self._pending.append((self._data_wait, self._talk_s, self._events))

    def _resolve_pending(self) -> None:
        if self._stamps:
            rows = _decode_stamps(self._stamps, self._talks, self._per_micro)
            if len(rows):
                self._rows.append(rows)
            self._stamps.clear()  # in place: the CPU closures append to this very list
            self._talks.clear()
        if not self._pending:
            return
        self._pending[-1][2][-1][2].synchronize()  # type: ignore[attr-defined]  # one sync per read
        rows = np.zeros((len(self._pending), len(_COLUMNS)))
        for row, (data_wait, talk_s, events) in zip(rows, self._pending, strict=True):
            row[_DATA], row[_TALK] = max(data_wait - talk_s, 0.0), talk_s
            for index, start, end in events:
                row[index] += start.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]
        self._rows.append(rows)
        self._pending = []

    @property
    def steps(self) -> int:
        self._resolve_pending()
        return sum(len(rows) for rows in self._rows)

    def summary(self, *, whole_run: bool = False) -> dict[str, PhaseStats]:
        """Per-phase statistics over the steps since the last ``reset`` (or the whole run).

        ``communication`` is there only when some step had any.
        """
        self._resolve_pending()
        chunks = self._run_rows + self._rows if whole_run else self._rows
        if not chunks:
            return {}
        return _summarize(np.concatenate(chunks))

    def reset(self) -> None:
        """Start a new epoch's statistics; the run's keep everything."""
        self._resolve_pending()
        self._run_rows.extend(self._rows)
        self._rows = []


def _nothing() -> None:
    """end_step on the CPU: the stamps already hold the step."""


def _decode_stamps(
    stamps: list[float], talks: list[tuple[int, float]], per_micro: int = 2
) -> np.ndarray:
    """Per-step rows of phase durations from host stamps: -start, data, (forward,
    backward) per micro-batch — (transfer, forward, backward) when ``per_micro`` is 3
    (an accelerator timed on the host, e.g. MPS) — then optimizer; ``talks`` are
    communication calls.
    A step without its optimizer stamp (the fetch that found the epoch empty) is
    dropped. Vectorized: an epoch's steps are decoded in a few array operations."""
    at = np.fromiter(stamps, np.float64, len(stamps))
    starts = np.flatnonzero(at < 0)
    if not len(starts):
        return np.zeros((0, len(_COLUMNS)))
    lengths = np.empty_like(starts)  # stamps per step: to the next start, or the end
    lengths[:-1], lengths[-1] = starts[1:], len(at)
    lengths -= starts
    talk_s = _talk_per_step(starts, talks)
    decoded, order = [], []
    for length in np.unique(lengths):  # one length, unless micro-batches per step vary
        if length < 3 + per_micro or (length - 3) % per_micro:
            continue
        chosen = np.flatnonzero(lengths == length)
        group = at[starts[chosen, None] + np.arange(length)]
        decoded.append(_durations(group, talk_s[chosen], per_micro))
        order.append(chosen)
    if not decoded:
        return np.zeros((0, len(_COLUMNS)))
    if len(decoded) == 1:
        return decoded[0]
    return np.concatenate(decoded)[np.argsort(np.concatenate(order), kind="stable")]


def _talk_per_step(starts: np.ndarray, talks: list[tuple[int, float]]) -> np.ndarray:
    """Communication seconds per step; a call made after stamp ``i - 1`` belongs to the
    step that stamp is in (calls before the first start belong to no step)."""
    talk_s = np.zeros(len(starts))
    if talks:
        where, seconds = (np.array(column) for column in zip(*talks, strict=True))
        step = np.searchsorted(starts, where - 1, side="right") - 1
        np.add.at(talk_s, step[step >= 0], seconds[step >= 0])
    return talk_s


def _durations(group: np.ndarray, talk_s: np.ndarray, per_micro: int) -> np.ndarray:
    """Rows for steps of the same number of stamps (``group``: one step's stamps a row)."""
    laps = np.diff(group[:, 1:], axis=1)  # ((transfer,) forward, backward) × m, optimizer
    micro = laps[:, :-1].reshape(len(group), -1, per_micro).sum(axis=1)
    rows = np.zeros((len(group), len(_COLUMNS)))  # transfer stays 0 on the CPU
    rows[:, _DATA] = np.maximum(group[:, 1] + group[:, 0] - talk_s, 0.0)
    rows[:, _TALK] = talk_s
    rows[:, _TALK + 4 - per_micro : _TALK + 4] = micro
    rows[:, -1] = laps[:, -1]
    return rows


def _summarize(rows: np.ndarray) -> dict[str, PhaseStats]:
    """Totals, medians, p95s and shares of every column and of the step, in one pass."""
    n = len(rows)
    table = np.column_stack([rows, rows.sum(axis=1)])  # the last column: whole steps
    ordered = np.sort(table, axis=0)
    medians = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2  # statistics.median's
    p95s = ordered[min(n - 1, max(0, round(0.95 * (n - 1))))]
    totals = table.sum(axis=0)
    whole = float(totals[-1]) or 1e-12
    stats = {}
    for index, phase in enumerate(_COLUMNS):
        if phase == COMMUNICATION and not totals[index]:
            continue  # single-process runs report the five phases they always did
        stats[phase] = PhaseStats(
            total_s=float(totals[index]),
            median_s=float(medians[index]),
            p95_s=float(p95s[index]),
            share=float(totals[index]) / whole,
        )
    stats["step"] = PhaseStats(float(totals[-1]), float(medians[-1]), float(p95s[-1]), 1.0)
    return stats


def _record_event() -> object:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def reported_phases(stats: dict[str, PhaseStats]) -> list[str]:
    """The phases in ``stats``, in table order (``communication`` when there is some)."""
    return [phase for phase in _COLUMNS if phase in stats]


def timing_record(stats: dict[str, PhaseStats]) -> dict[str, float]:
    """The metric keys for an epoch: totals per phase, step median/p95, data stall %.

    The data stall is data wait alone: time spent waiting for other ranks is
    ``time/communication_s``, not a slow loader.
    """
    if not stats:
        return {}
    record = {f"time/{phase}_s": stats[phase].total_s for phase in reported_phases(stats)}
    record["time/step_s"] = stats["step"].median_s
    record["time/step_p95_s"] = stats["step"].p95_s
    record["time/data_stall_pct"] = 100.0 * stats["data_wait"].share
    return record
