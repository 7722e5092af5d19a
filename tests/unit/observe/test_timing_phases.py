"""PhaseTimer's decoding and summary, and the communication phase of distributed runs."""

from __future__ import annotations

import statistics
from types import SimpleNamespace

import pytest
import torch

from stoker.observe import timing
from stoker.observe.timing import COMMUNICATION, PHASES, PhaseTimer, timing_record
from stoker.observe.verdict import judge, run_summary, summary_lines


class _Clock:
    """A perf_counter that moves on by the given seconds at each read."""

    def __init__(self) -> None:
        self.now = 100.0
        self.steps: list[float] = []

    def __call__(self) -> float:
        self.now += self.steps.pop(0) if self.steps else 0.0
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=fake))
    return fake


def _step(
    timer: PhaseTimer,
    clock: _Clock,
    *,
    fetch: float,
    talks: tuple[float, ...] = (),
    micro: int = 1,
    lap: float = 0.001,
    optimizer: float = 0.004,
) -> None:
    """One step in the loop's order; the fetch takes ``fetch`` s, of which ``talks`` are
    collectives (as RankSyncedLoader reports them). On the CPU there is no transfer to
    time: two clock reads per micro-batch, and the arrival's reading stands for the end of
    the transfer. The optimizer's time is what the next clock read (the next step's
    start, or ``close_step``) finds has passed."""
    fetching = timer.now()  # ends the step before, reading its optimizer time
    # Each communication call reads the clock too (when the collective ended).
    clock.steps += [0.0] * len(talks) + [fetch] + [lap] * (2 * micro) + [optimizer]
    for seconds in talks:
        timer.communication(seconds)
    readings = [fetching, timer.now()]
    for _ in range(micro):
        transferred = readings[-1]  # as the loop: the CPU has no copy to time
        readings += (transferred, timer.now(), timer.now())
    timer.record(tuple(readings))


def _empty_fetch(timer: PhaseTimer, clock: _Clock, *, fetch: float, talk: float = 0.0) -> None:
    """The fetch that finds the epoch over: it ends the step before, and is no step."""
    fetching = timer.now()
    clock.steps += [0.0, fetch] if talk else [fetch]
    if talk:
        timer.communication(talk)  # the ranks agreed that the epoch is over
    timer.now()
    timer.close_step(fetching)


def test_stamps_decode_to_each_phase_with_any_number_of_micro_batches(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    _step(timer, clock, fetch=0.010, micro=1)
    _step(timer, clock, fetch=0.020, micro=3)
    _step(timer, clock, fetch=0.030, micro=1)
    _empty_fetch(timer, clock, fetch=0.005)
    stats = timer.summary()
    assert timer.steps == 3
    assert stats["data_wait"].total_s == pytest.approx(0.060)
    assert stats["data_wait"].median_s == pytest.approx(0.020)
    assert stats["forward"].total_s == pytest.approx(0.001 * 5)
    assert stats["optimizer"].p95_s == pytest.approx(0.004)
    assert stats["transfer"].total_s == 0.0  # no copy on the CPU
    steps = [0.010 + 0.006, 0.020 + 0.010, 0.030 + 0.006]
    assert stats["step"].median_s == pytest.approx(statistics.median(steps))
    assert stats["step"].total_s == pytest.approx(sum(steps))
    assert COMMUNICATION not in stats  # a single-process run reports what it always did
    assert list(stats) == [*PHASES, "step"]
    assert set(timing_record(stats)) == {f"time/{p}_s" for p in PHASES} | {
        "time/step_s",
        "time/step_p95_s",
        "time/data_stall_pct",
    }


def test_communication_is_taken_out_of_the_data_wait(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(4):
        # 20 ms fetch: 18 ms of it waiting for the other ranks, in two collectives
        _step(timer, clock, fetch=0.020, talks=(0.012, 0.006), micro=2)
    timer.close_step()
    stats = timer.summary()
    assert stats[COMMUNICATION].total_s == pytest.approx(4 * 0.018)
    assert stats["data_wait"].median_s == pytest.approx(0.002)
    assert stats["step"].median_s == pytest.approx(0.020 + 4 * 0.001 + 0.004)
    assert sum(stats[p].share for p in stats if p != "step") == pytest.approx(1.0)
    record = timing_record(stats)
    assert record["time/communication_s"] == pytest.approx(0.072)
    assert record["time/data_stall_pct"] == pytest.approx(100 * 0.002 / 0.028)


def test_communication_of_the_empty_last_fetch_is_dropped_with_it(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    timer.communication(0.5)  # before any step (set_epoch's check): no step's
    clock.steps += [0.001]
    _step(timer, clock, fetch=0.010, talks=(0.004,))
    _empty_fetch(timer, clock, fetch=0.003, talk=0.003)
    stats = timer.summary()
    assert timer.steps == 1
    assert stats[COMMUNICATION].total_s == pytest.approx(0.004)


def test_epochs_keep_their_own_communication(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    _step(timer, clock, fetch=0.010, talks=(0.004,))
    timer.reset()
    _step(timer, clock, fetch=0.010)
    timer.close_step()
    assert COMMUNICATION not in timer.summary()
    assert timer.summary(whole_run=True)[COMMUNICATION].total_s == pytest.approx(0.004)


def test_a_rank_waiting_for_others_is_not_input_bound(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(5):
        _step(timer, clock, fetch=0.050, talks=(0.049,), optimizer=0.005)
    timer.close_step()
    stats = timer.summary()
    verdict = judge(stats, num_workers=2, device_type="cpu")
    # 86% of the step waiting for the other ranks: that, not data, is what bounds it.
    assert verdict.verdict == "communication-bound"
    assert "waits for the other ranks 86% of each step" in verdict.recommendation
    assert verdict.data_stall_pct == pytest.approx(100 * 0.001 / 0.057)
    summary = run_summary(stats, num_workers=2, device_type="cpu", samples_per_s=10.0)
    assert list(summary["phases"]) == ["data_wait", COMMUNICATION, *PHASES[1:], "step"]
    lines = summary_lines(summary)
    assert any(line.startswith("communication ") and "86.0%" in line for line in lines)
    assert len({len(line) for line in lines[:-2]}) == 1  # the columns still line up


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_communication_on_cuda_is_a_host_time_taken_out_of_the_data_wait() -> None:
    timer = PhaseTimer(torch.device("cuda"))
    x = torch.randn(256, 256, device="cuda")
    for _ in range(3):
        fetching = timer.now()
        timer.communication(0.002)
        timer.communication(0.001)
        wait_until = timing.time.perf_counter() + 0.005
        while timing.time.perf_counter() < wait_until:
            pass
        readings = [fetching, timer.now()]
        for _phase in PHASES[1:-1]:
            x = x @ x / 256
            readings.append(timer.now())
        timer.record(tuple(readings))
        x = x @ x / 256  # the optimizer phase: until the next fetch
    timer.close_step()
    stats = timer.summary()
    assert timer.steps == 3 and stats["optimizer"].total_s > 0
    assert stats[COMMUNICATION].total_s == pytest.approx(0.009)
    assert stats["data_wait"].median_s == pytest.approx(0.002, abs=0.002)
    assert timing_record(stats)["time/communication_s"] == pytest.approx(0.009)


def test_a_host_timed_accelerator_keeps_its_transfer_stamp(clock) -> None:
    timer = PhaseTimer(torch.device("meta"))  # not the CPU, not CUDA: stamps on the host
    assert timer.times_transfer
    clock.steps += [0.0, 0.010, 0.003, 0.001, 0.002, 0.004]
    timer.record(tuple(timer.now() for _ in range(5)))  # start, arrival, transfer, fwd, bwd
    timer.close_step()
    stats = timer.summary()
    assert stats["transfer"].total_s == pytest.approx(0.003)
    assert stats["forward"].total_s == pytest.approx(0.001)
    assert stats["backward"].total_s == pytest.approx(0.002)
    assert stats["step"].total_s == pytest.approx(0.020)


def test_the_optimizer_phase_runs_to_the_next_fetch_unless_the_step_is_closed(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    _step(timer, clock, fetch=0.010, optimizer=0.004)
    _step(timer, clock, fetch=0.010, optimizer=0.006)
    timer.close_step()  # e.g. before a checkpoint save: 0.5 s that is no step's
    clock.steps += [0.5]
    _step(timer, clock, fetch=0.010, optimizer=0.002)
    timer.close_step()
    timer.close_step()  # a second close adds nothing
    stats = timer.summary()
    assert timer.steps == 3
    assert stats["optimizer"].total_s == pytest.approx(0.004 + 0.006 + 0.002)
    assert stats["step"].total_s == pytest.approx(3 * 0.012 + 0.012)


def test_a_step_still_open_at_a_summary_is_kept_for_the_next(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    _step(timer, clock, fetch=0.010, talks=(0.003,))
    _step(timer, clock, fetch=0.020, talks=(0.005,), optimizer=0.007)
    assert timer.steps == 1  # the second has not ended: its optimizer runs on
    first = timer.summary()
    assert first[COMMUNICATION].total_s == pytest.approx(0.003)
    timer.close_step()
    stats = timer.summary()
    assert timer.steps == 2
    assert stats[COMMUNICATION].total_s == pytest.approx(0.008)
    assert stats["data_wait"].total_s == pytest.approx(0.007 + 0.015)
    assert stats["optimizer"].total_s == pytest.approx(0.004 + 0.007)


def test_reset_ends_an_open_step_before_the_next_epoch(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    _step(timer, clock, fetch=0.010, optimizer=0.004)
    timer.reset()
    clock.steps += [1.0]  # validation between the epochs
    _step(timer, clock, fetch=0.010, optimizer=0.004)
    timer.close_step()
    assert timer.summary(whole_run=True)["step"].total_s == pytest.approx(2 * 0.016)


def test_an_empty_fetch_ends_the_step_before_where_it_began(clock) -> None:
    timer = PhaseTimer(torch.device("cpu"))
    _step(timer, clock, fetch=0.003, optimizer=0.004)
    _step(timer, clock, fetch=0.003, optimizer=0.004)
    _empty_fetch(timer, clock, fetch=0.5)  # e.g. the loader shutting its workers down
    clock.steps += [1.0]
    timer.close_step()  # the epoch's end: the step is already over
    stats = timer.summary()
    assert timer.steps == 2
    assert stats["data_wait"].total_s == pytest.approx(0.006)
    assert stats["optimizer"].total_s == pytest.approx(0.008)


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: a device time, and whether it was waited on."""

    def __init__(self, device_s: float) -> None:
        self.device_s = device_s
        self.waited = False

    def elapsed_time(self, end: _FakeEvent) -> float:
        return (end.device_s - self.device_s) * 1000.0  # milliseconds, as CUDA's

    def synchronize(self) -> None:
        self.waited = True


def test_cuda_readings_time_device_phases_between_events(monkeypatch) -> None:
    """The CUDA path without a GPU: host clocks give the data wait and communication,
    events the device phases."""
    host = iter([0.0, 0.006, 0.010, 0.011, 0.012, 0.013, 0.050, 0.051, 0.052])
    device = iter([0.0, 0.020, 0.025, 0.035, 0.055, 0.070, 0.071])
    events: list[_FakeEvent] = []

    def host_clock() -> float:
        return next(host)

    def reading() -> tuple[float, _FakeEvent]:
        events.append(_FakeEvent(next(device)))
        return host_clock(), events[-1]

    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=host_clock))
    monkeypatch.setattr(timing, "_host_and_event", reading)
    timer = PhaseTimer(torch.device("cuda"))
    assert timer.times_transfer
    fetching = timer.now()  # host 0.0
    timer.communication(0.004)  # host 0.006: during this step's fetch
    # arrival, transfer, forward, backward: host 0.010 on; device 0.020, 0.025, 0.035, 0.055
    timer.record((fetching, *(timer.now() for _ in range(4))))
    fetching = timer.now()  # host 0.050, device 0.070: the step before ends here
    timer.communication(0.001)  # host 0.051: the ranks agree the epoch is over
    timer.now()
    timer.close_step(fetching)  # that fetch found no batch
    stats = timer.summary()
    assert timer.steps == 1
    assert stats[COMMUNICATION].total_s == pytest.approx(0.004)  # the empty fetch's: dropped
    assert stats["data_wait"].total_s == pytest.approx(0.010 - 0.004)
    assert stats["transfer"].total_s == pytest.approx(0.005)  # device: 0.020 -> 0.025
    assert stats["forward"].total_s == pytest.approx(0.010)
    assert stats["backward"].total_s == pytest.approx(0.020)
    assert stats["optimizer"].total_s == pytest.approx(0.015)  # 0.055 -> the fetch at 0.070
    assert events[5].waited and not any(event.waited for event in events[:5])
