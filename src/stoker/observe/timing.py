"""Per-step phase timers: data wait, transfer, forward, backward, optimizer (and, in a
distributed run, the communication that fetching a batch waits in).

On the CPU a phase ends with a ``perf_counter`` read (tens of nanoseconds), and
``transfer`` is reported as 0: training on the CPU the batch is already where it is
used (``Loop.to_device`` passes it through), so the loop takes no stamp for it and
``lap("transfer")`` is a no-op there (``PhaseTimer.times_transfer`` is False). Steps
share their boundaries: the clock read that starts a step also ends the one before, so
a step costs four reads (start, data ready, forward, backward) and its optimizer phase
runs to the next fetch — the optimizer step, the lr schedule and the loop's own
bookkeeping between steps. Work that is not part of a step (a checkpoint, a metrics
record) is cut out with ``close_step``; on CUDA too, where the optimizer phase ends at
an event recorded at the next fetch. On CUDA the host runs ahead of the device, so
host clocks would time kernel *launches*; there each phase boundary records a CUDA
event instead, and the events are read lazily — when ``summary`` is asked for, once per
epoch — so timing adds no synchronization to the step. Data wait is always a host
time: it is the time the training thread is blocked on the loader, less the time it
spent in collectives (``PhaseTimer.communication``), which is the ``communication``
phase.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

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

    A step: ``fetch`` the batch (or ``start_step``, fetch, ``data_ready``), then
    ``lap(phase)`` at the end of transfer, forward and backward (several times per step
    with gradient accumulation: laps add up). The optimizer phase has no call of its
    own: it ends where the next step's fetch starts, so the loop's bookkeeping between
    steps counts as the optimizer phase's. Call ``close_step`` before work that is no
    step's (a checkpoint save, a metrics record, the end of an epoch): the time until the
    next fetch then counts nowhere. A loader that waits in a collective while fetching
    calls ``communication(seconds)``.
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
        # Host: one perf_counter stamp per boundary, a step's start stored negated; the
        # durations are worked out when read, so the step itself only appends floats.
        self._stamps: list[float] = []
        # Host: (stamps so far, seconds) per communication call, for the step it falls in.
        self._talks: list[tuple[int, float]] = []
        # Host: len(_stamps) after the last close_step, so a second one adds nothing.
        self._closed_at = -1
        # CUDA: ended steps (data wait, communication, events), and the open step's.
        self._pending: list[tuple[float, float, list[tuple[int, object, object]]]] = []
        self._events: list[tuple[int, object, object]] = []
        self._step_started = 0.0
        self._data_wait = 0.0
        self._talk_s = 0.0
        self._last_event: object | None = None
        if not self._cuda:
            self._use_host_calls()

    def _use_host_calls(self) -> None:
        """Replace the hot calls by closures over the stamp list: on the host each call is
        then clock reads and appends, with no attribute lookups. In the loop a call costs
        more than the clock read it makes (see benchmarks/instrumentation.py), so the
        fetch takes one call for its two stamps."""
        append, clock = self._stamps.append, time.perf_counter

        def start_step() -> None:
            append(-clock())

        def data_ready() -> None:
            append(clock())

        def fetch(batches: Iterator[Any], default: Any = None) -> Any:
            append(-clock())
            batch = next(batches, default)
            append(clock())
            return batch

        def lap(phase: str) -> None:
            if phase != "transfer":  # on the CPU there is no copy to time
                append(clock())

        def stamp(phase: str) -> None:  # an accelerator timed on the host: every phase
            append(clock())

        self.start_step = start_step  # type: ignore[method-assign]
        self.data_ready = data_ready  # type: ignore[method-assign]
        self.fetch = fetch  # type: ignore[method-assign]
        self.lap = stamp if self.times_transfer else lap  # type: ignore[method-assign]

    def start_step(self) -> None:
        """The fetch of a step's batch begins, and the step before ends."""
        if self._cuda:
            self._end_open_step()
            self._talk_s = 0.0
            self._step_started = time.perf_counter()
        else:
            self._stamps.append(-time.perf_counter())

    def communication(self, seconds: float) -> None:
        """``seconds`` of this step's data fetch went waiting in a collective (the ranks
        agreeing that all have a batch): the communication phase, not data wait.

        Call it between ``start_step`` and ``data_ready`` (inside ``fetch``), once per
        collective or once with their sum; calls add up. Unlike the other calls it is not
        made in a single-process run, so it is an ordinary method.
        """
        if self._cuda:
            self._talk_s += seconds
        else:
            self._talks.append((len(self._stamps), seconds))

    def data_ready(self) -> None:
        """The step's batch has arrived."""
        if self._cuda:
            self._data_wait = time.perf_counter() - self._step_started
            self._last_event = _record_event()
        else:
            self._stamps.append(time.perf_counter())

    def fetch(self, batches: Iterator[Any], default: Any = None) -> Any:
        """``start_step``, ``next(batches, default)``, ``data_ready``: the step's fetch."""
        self.start_step()
        batch = next(batches, default)
        self.data_ready()
        return batch

    def lap(self, phase: str) -> None:
        """End ``phase``: transfer, forward or backward. On the host the order is the
        loop's, so only the time is kept; on the CPU transfer takes no stamp."""
        if self._cuda:
            event = _record_event()
            self._events.append((_INDEX[phase], self._last_event, event))
            self._last_event = event
        elif self.times_transfer or phase != "transfer":
            self._stamps.append(time.perf_counter())

    def close_step(self) -> None:
        """End the current step now: what runs until the next fetch is no step's time."""
        if self._cuda:
            self._end_open_step()
            return
        stamps = self._stamps
        if stamps and len(stamps) != self._closed_at:
            stamps.append(time.perf_counter())
            self._closed_at = len(stamps)

    def _end_open_step(self) -> None:
        """CUDA: an event after the open step's optimizer work ends it (a fetch that found
        no batch has no laps and is no step)."""
        if self._events:
            end = _record_event()
            self._events.append((_INDEX["optimizer"], self._last_event, end))
            # Device times are read later, when the events have surely completed.
            self._pending.append((self._data_wait, self._talk_s, self._events))
        self._events = []

    def _resolve_pending(self) -> None:
        if self._stamps:
            self._decode_stamps()
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

    def _decode_stamps(self) -> None:
        """Decode the ended steps' stamps into rows; keep an open last step's stamps."""
        rows, kept_from = _decode_stamps(self._stamps, self._talks, self._per_micro)
        if len(rows):
            self._rows.append(rows)
        # In place: the host closures append to this very list.
        del self._stamps[:kept_from]
        self._talks[:] = [(at - kept_from, s) for at, s in self._talks if at > kept_from]
        self._closed_at = -1

    @property
    def steps(self) -> int:
        self._resolve_pending()
        return sum(len(rows) for rows in self._rows)

    def summary(self, *, whole_run: bool = False) -> dict[str, PhaseStats]:
        """Per-phase statistics over the ended steps since the last ``reset`` (or the
        whole run). ``communication`` is there only when some step had any.
        """
        self._resolve_pending()
        chunks = self._run_rows + self._rows if whole_run else self._rows
        if not chunks:
            return {}
        return _summarize(np.concatenate(chunks) if len(chunks) > 1 else chunks[0])

    def reset(self) -> None:
        """Start a new epoch's statistics; the run's keep everything. A step still open
        ends here: what ran since (validation, a checkpoint) is no step's time."""
        self.close_step()
        self._resolve_pending()
        self._run_rows.extend(self._rows)
        self._rows = []


def _decode_stamps(
    stamps: list[float], talks: list[tuple[int, float]], per_micro: int = 2
) -> tuple[np.ndarray, int]:
    """Per-step rows of phase durations from host stamps, and where the stamps of a
    step that has not ended yet begin (all of them are decoded when that is the length).

    A step's stamps: -start, data ready, then (forward, backward) per micro-batch —
    (transfer, forward, backward) when ``per_micro`` is 3 (an accelerator timed on the
    host, e.g. MPS) — and, when ``close_step`` ended it, one more. Otherwise it ends
    at the next step's start. ``talks`` are communication calls. A fetch that found the
    epoch empty (a start and data ready, nothing more) is no step. Vectorized: an
    epoch's steps are decoded in a few array operations.
    """
    at = np.fromiter(stamps, np.float64, len(stamps))
    starts = np.flatnonzero(at < 0)
    if not len(starts):
        return np.zeros((0, len(_COLUMNS))), len(stamps)
    lengths = np.diff(starts, append=len(at))  # stamps per step: to the next start, or the end
    body = lengths - 2  # after the start and data-ready stamps
    closed = body % per_micro == 1  # close_step added the end stamp
    micro, rest = np.divmod(body - closed, per_micro)
    open_last = not closed[-1] and micro[-1] > 0
    kept_from = int(starts[-1]) if open_last else len(stamps)
    # A step that did not close itself ends where the next one starts.
    ends = np.empty(len(starts))
    ends[:-1] = -at[starts[1:]]
    ends[closed] = at[starts[closed] + lengths[closed] - 1]
    valid = (micro > 0) & (rest == 0)
    valid[-1] &= not open_last
    talk_s = _talk_per_step(starts, talks)
    counts = micro[valid]
    if not len(counts):
        return np.zeros((0, len(_COLUMNS))), kept_from
    if counts.min() == counts.max():  # the usual case: one number of micro-batches
        chosen = np.flatnonzero(valid)
        return _group_rows(at, starts, ends, talk_s, chosen, int(counts[0]), per_micro), kept_from
    decoded, order = [], []
    for count in np.unique(counts):  # micro-batches per step vary (a short last group)
        chosen = np.flatnonzero(valid & (micro == count))
        decoded.append(_group_rows(at, starts, ends, talk_s, chosen, int(count), per_micro))
        order.append(chosen)
    rows = np.concatenate(decoded)[np.argsort(np.concatenate(order), kind="stable")]
    return rows, kept_from


def _group_rows(
    at: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    talk_s: np.ndarray,
    chosen: np.ndarray,
    micro: int,
    per_micro: int,
) -> np.ndarray:
    """Rows for the ``chosen`` steps, which all have ``micro`` micro-batches."""
    width = 2 + per_micro * micro
    group = np.empty((len(chosen), width + 1))
    group[:, :width] = at[starts[chosen, None] + np.arange(width)]
    group[:, width] = ends[chosen]
    return _durations(group, talk_s[chosen], per_micro)


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
    """Rows for steps of the same number of micro-batches (``group``: one step's stamps
    a row, its end last)."""
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
    table = np.empty((n, rows.shape[1] + 1))  # the last column: whole steps
    table[:, :-1] = rows
    rows.sum(axis=1, out=table[:, -1])
    table.sort(axis=0)
    medians = (table[(n - 1) // 2] + table[n // 2]) / 2  # statistics.median's
    p95s = table[min(n - 1, max(0, round(0.95 * (n - 1))))]
    totals = table.sum(axis=0)
    whole = float(totals[-1]) or 1e-12
    medians, p95s, totals = medians.tolist(), p95s.tolist(), totals.tolist()
    stats = {}
    for index, phase in enumerate(_COLUMNS):
        if phase == COMMUNICATION and not totals[index]:
            continue  # single-process runs report the five phases they always did
        stats[phase] = PhaseStats(
            total_s=totals[index],
            median_s=medians[index],
            p95_s=p95s[index],
            share=totals[index] / whole,
        )
    stats["step"] = PhaseStats(totals[-1], medians[-1], p95s[-1], 1.0)
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
