"""Per-step phase timers: data wait, transfer, forward, backward, optimizer (and, in a
distributed run, the communication that fetching a batch waits in).

The loop reads the clock at each boundary of a step into a local and hands the step's
readings over in one call at its end (see ``PhaseTimer``): on the CPU a step costs four
``perf_counter`` reads and one list append, and no Python call of the timer's own — in
a training step each call costs several times its ``timeit`` figure
(``benchmarks/instrumentation.py``). Steps share their boundaries: the reading that
starts a step's fetch also ends the step before, so the optimizer phase runs to the
next fetch — the optimizer step, the lr schedule and the loop's own bookkeeping
between steps. Work that is not part of a step (a checkpoint, a metrics record) is cut
out with ``close_step``.

On the CPU ``transfer`` is 0: the batch is already where it is used (``Loop.to_device``
passes it through), so the loop reads no clock for it (``PhaseTimer.times_transfer`` is
False) and hands over the arrival reading again. On CUDA the host runs ahead of the
device, so host clocks would time kernel *launches*; there each reading also records a
CUDA event, the device phases are timed between events, and the events are read
lazily — when ``summary`` is asked for, once per epoch — so timing adds no
synchronization to the step. Data wait is always a host time: it is the time the
training thread is blocked on the loader, less the time it spent in collectives
(``PhaseTimer.communication``), which is the ``communication`` phase.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
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
_DATA, _TALK, _OPTIMIZER = _INDEX["data_wait"], _INDEX[COMMUNICATION], _INDEX["optimizer"]
#: The columns of a micro-batch's three laps: transfer, forward, backward.
_LAPS = slice(_INDEX["transfer"], _INDEX["backward"] + 1)
#: Readings per micro-batch after the fetch's two: at the end of transfer, forward, backward.
_PER_MICRO = 3

#: A clock reading: seconds on the host; (seconds, CUDA event) on CUDA.
Reading = Any


@dataclass(frozen=True)
class PhaseStats:
    """One phase over an epoch: total, median and p95 per step, share of step time."""

    total_s: float
    median_s: float
    p95_s: float
    share: float


class PhaseTimer:
    """Takes each step's clock readings; summarizes them per epoch.

    A step, as the loop makes it::

        fetching = timer.now()      # the step starts (and the one before ends)
        batch = next(batches)
        fetched = timer.now()       # the batch has arrived
        transferred = timer.now()   # after the copy (on the CPU: the reading before)
        forwarded = timer.now()     # after forward and loss
        backwarded = timer.now()    # after backward
        timer.record((fetching, fetched, transferred, forwarded, backwarded))

    With gradient accumulation the last three readings come once per micro-batch, in
    that order. The optimizer phase has no reading of its own: it ends at the next
    step's ``fetching``. Call ``close_step`` before work that is no step's (a checkpoint
    save, a metrics record, the end of an epoch): the time until the next fetch then
    counts nowhere. A fetch that finds no batch is no step: ``close_step(fetching)``
    ends the step before where that fetch began. A loader that waits in a collective
    while fetching calls ``communication(seconds)``.
    """

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        #: Whether the loop reads the clock after a transfer: on the CPU there is no copy.
        self.times_transfer = device.type != "cpu"
        #: Reads the clock at a phase boundary (on the host, ``perf_counter`` itself).
        self.now: Callable[[], Reading] = _host_and_event if self._cuda else time.perf_counter
        # The recorded steps' readings, a tuple each, not decoded yet.
        self._steps: list[tuple[Reading, ...]] = []
        #: Hands over one step's readings: the list's own append, so no Python frame.
        self.record: Callable[[tuple[Reading, ...]], None] = self._steps.append
        # (steps recorded before, seconds, host clock) per communication call: the step
        # being fetched then, if its fetch had begun.
        self._talks: list[tuple[int, float, float]] = []
        # (steps recorded before, reading) per close_step: the last recorded step's end.
        self._closes: list[tuple[int, Reading]] = []
        # Decoded steps, one row of _COLUMNS each, an array per decode.
        self._rows: list[np.ndarray] = []
        self._run_rows: list[np.ndarray] = []

    def communication(self, seconds: float) -> None:
        """``seconds`` of the current fetch went waiting in a collective (the ranks
        agreeing that all have a batch): the communication phase, not data wait.

        Call it during the fetch (between ``fetching`` and ``fetched``), once per
        collective or once with their sum; calls add up. A call outside any step's
        fetch (before an epoch's first, or in a fetch that finds no batch) belongs to no
        step and is dropped. Only distributed runs call it: its clock read is no cost to
        a single process.
        """
        self._talks.append((len(self._steps), seconds, time.perf_counter()))

    def close_step(self, at: Reading | None = None) -> None:
        """End the last recorded step now (or at the reading ``at``): what runs until
        the next fetch is no step's time. A second close adds nothing."""
        count, closes = len(self._steps), self._closes
        if count and not (closes and closes[-1][0] == count):
            closes.append((count, self.now() if at is None else at))

    def _decode(self) -> None:
        """Decode the ended steps into rows; keep an open last step, with its talks.

        Called between steps (no fetch is under way), so a talk with no recorded step
        to go with belongs to none.
        """
        decode = _device_rows if self._cuda else _host_rows
        rows, decoded = decode(self._steps, self._talks, self._closes)
        if len(rows):
            self._rows.append(rows)
        del self._steps[:decoded]  # in place: `record` is this very list's append
        kept = len(self._steps)  # 1 while the last step is open, else 0
        self._talks[:] = [
            (at - decoded, *talk) for at, *talk in self._talks if 0 <= at - decoded < kept
        ]
        self._closes.clear()  # an open step has none

    @property
    def steps(self) -> int:
        """Steps ended since the last ``reset``."""
        self._decode()
        return sum(len(rows) for rows in self._rows)

    def summary(self, *, whole_run: bool = False) -> dict[str, PhaseStats]:
        """Per-phase statistics over the ended steps since the last ``reset`` (or the
        whole run). ``communication`` is there only when some step had any.
        """
        self._decode()
        chunks = self._run_rows + self._rows if whole_run else self._rows
        if not chunks:
            return {}
        return _summarize(np.concatenate(chunks) if len(chunks) > 1 else chunks[0])

    def reset(self) -> None:
        """Start a new epoch's statistics; the run's keep everything. A step still open
        ends here: what ran since (validation, a checkpoint) is no step's time."""
        self.close_step()
        self._decode()
        self._run_rows.extend(self._rows)
        self._rows = []


def _host_and_event() -> tuple[float, object]:
    """A CUDA reading: the host clock, and an event recorded on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return time.perf_counter(), event


def _ends(steps: Sequence[tuple[Reading, ...]], closes: list[tuple[int, Reading]]) -> list:
    """Each step's end: its close, else the next step's start; None while it is open."""
    ends: list[Reading | None] = [step[0] for step in steps[1:]]
    ends.append(None)
    for count, reading in closes:
        ends[count - 1] = reading  # the close came when `count` steps were recorded
    return ends


def _talk_seconds(
    talks: list[tuple[int, float, float]], starts: Sequence[float], count: int
) -> np.ndarray:
    """Communication seconds of each of the first ``count`` steps: the calls made after
    the step's fetch began (``starts``: each step's fetch start on the host clock)."""
    seconds = np.zeros(count)
    for at, talked, when in talks:
        if at < count and when >= starts[at]:
            seconds[at] += talked
    return seconds


def _host_rows(
    steps: list[tuple[float, ...]],
    talks: list[tuple[int, float, float]],
    closes: list[tuple[int, float]],
) -> tuple[np.ndarray, int]:
    """Rows of the ended steps from host readings, and how many steps that is (all but
    an open last one). Vectorized: an epoch's steps take a few array operations."""
    count = len(steps)
    if not count:
        return np.zeros((0, len(_COLUMNS))), 0
    widths = {len(step) for step in steps}
    if len(widths) == 1:  # one number of micro-batches: the usual case
        (width,) = widths
        flat = np.fromiter(itertools.chain.from_iterable(steps), np.float64, count * width)
        table = flat.reshape(count, width)
        ends = np.empty(count)
        ends[:-1] = table[1:, 0]  # a step ends where the next one starts,
        ends[-1] = np.nan
        for at, reading in closes:  # or where close_step ended it
            ends[at - 1] = reading
        decoded = count if not np.isnan(ends[-1]) else count - 1
        rows = _durations(table[:decoded], ends[:decoded])
    else:  # accumulation with a short last group: a table per number of micro-batches
        ends_list = _ends(steps, closes)
        decoded = count if ends_list[-1] is not None else count - 1
        rows = np.empty((decoded, len(_COLUMNS)))
        for width in widths:
            chosen = [i for i in range(decoded) if len(steps[i]) == width]
            table = np.array([steps[i] for i in chosen], dtype=np.float64).reshape(-1, width)
            rows[chosen] = _durations(table, np.array([ends_list[i] for i in chosen]))
    if talks:
        talk_s = _talk_seconds(talks, [step[0] for step in steps[:decoded]], decoded)
        rows[:, _TALK] = talk_s
        np.maximum(rows[:, _DATA] - talk_s, 0.0, out=rows[:, _DATA])
    return rows, decoded


def _durations(table: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Rows for steps of one number of micro-batches: ``table`` holds a step's readings
    a row, ``ends`` each step's end."""
    rows = np.zeros((len(table), len(_COLUMNS)))
    if not len(table):
        return rows
    np.subtract(table[:, 1], table[:, 0], out=rows[:, _DATA])
    laps = table[:, 2:] - table[:, 1:-1]  # (transfer, forward, backward) per micro-batch
    rows[:, _LAPS] = laps.reshape(len(table), -1, _PER_MICRO).sum(axis=1)
    np.subtract(ends, table[:, -1], out=rows[:, _OPTIMIZER])
    return rows


def _device_rows(
    steps: list[tuple[tuple[float, Any], ...]],
    talks: list[tuple[int, float, float]],
    closes: list[tuple[int, tuple[float, Any]]],
) -> tuple[np.ndarray, int]:
    """``_host_rows`` for CUDA readings: data wait from the host clocks, the device
    phases between the events, read after one synchronization (on the newest end)."""
    if not steps:
        return np.zeros((0, len(_COLUMNS))), 0
    ends = _ends(steps, closes)
    decoded = len(steps) if ends[-1] is not None else len(steps) - 1
    rows = np.zeros((decoded, len(_COLUMNS)))
    if not decoded:
        return rows, 0
    ends[decoded - 1][1].synchronize()  # the one sync: every earlier event is done too
    talk_s = _talk_seconds(talks, [step[0][0] for step in steps[:decoded]], decoded)
    for row, step, end, talked in zip(rows, steps, ends, talk_s, strict=False):
        (started, _), (arrived, previous), *marks = step
        row[_DATA], row[_TALK] = max(arrived - started - talked, 0.0), talked
        for index, (_, event) in enumerate(marks):
            row[_LAPS.start + index % _PER_MICRO] += previous.elapsed_time(event) / 1000.0
            previous = event
        row[_OPTIMIZER] = previous.elapsed_time(end[1]) / 1000.0
    return rows, decoded


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
