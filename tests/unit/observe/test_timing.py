"""Phase timers, the run verdict and system metrics."""

from __future__ import annotations

import time

import pytest
import torch

from stoker.observe.system import SystemMonitor, environment, peak_rss_mib
from stoker.observe.timing import PHASES, PhaseStats, PhaseTimer, timing_record
from stoker.observe.verdict import judge, run_summary, summary_lines


class FakeClock:
    """A clock that moves only when told to: timings a busy machine cannot disturb."""

    def __init__(self) -> None:
        self.time = 100.0

    def now(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += seconds


def _timer(clock: FakeClock) -> PhaseTimer:
    """A CPU timer reading ``clock`` (the loop reads ``timer.now`` at each phase's end)."""
    timer = PhaseTimer(torch.device("cpu"))
    timer.now = clock.now
    return timer


def _step(timer: PhaseTimer, waits: dict[str, float], clock: FakeClock) -> None:
    """One step as the loop times it: a reading at each phase's end, handed over at once."""
    fetching = timer.now()
    clock.sleep(waits.get("data_wait", 0))
    readings = [fetching, timer.now()]
    for phase in PHASES[1:-1]:
        clock.sleep(waits.get(phase, 0))
        if phase == "transfer" and not timer.times_transfer:  # as the loop: no copy on the CPU
            readings.append(readings[-1])
        else:
            readings.append(timer.now())
    timer.record(tuple(readings))
    clock.sleep(waits.get("optimizer", 0))  # the optimizer phase ends at the next fetch


def test_phase_timer_attributes_time_to_the_right_phase() -> None:
    clock = FakeClock()
    timer = _timer(clock)
    waits = {"data_wait": 0.06, "forward": 0.02, "backward": 0.03, "optimizer": 0.012}
    for _ in range(3):
        _step(timer, waits, clock)
    timer.close_step()
    stats = timer.summary()
    assert timer.steps == 3
    for phase in PHASES:  # each phase holds its own wait, and no neighbour's
        assert stats[phase].median_s == pytest.approx(waits.get(phase, 0.0)), phase
    assert stats["step"].median_s == pytest.approx(sum(waits.values()))
    assert stats["data_wait"].share > stats["forward"].share
    assert sum(stats[p].share for p in PHASES) == pytest.approx(1.0)
    record = timing_record(stats)
    assert record["time/data_stall_pct"] == pytest.approx(100 * stats["data_wait"].share)
    assert set(record) >= {f"time/{p}_s" for p in PHASES} | {"time/step_s", "time/step_p95_s"}


def test_laps_add_up_over_micro_batches() -> None:
    clock = FakeClock()
    timer = _timer(clock)
    readings = [timer.now(), timer.now()]
    for _ in range(3):  # three micro-batches, in the loop's order
        transferred = readings[-1]  # no copy on the CPU: no reading either
        clock.sleep(0.005)
        forwarded = timer.now()
        clock.sleep(0.002)
        readings += (transferred, forwarded, timer.now())
    timer.record(tuple(readings))
    timer.close_step()
    stats = timer.summary()
    assert stats["forward"].total_s == pytest.approx(0.015)
    assert stats["backward"].total_s == pytest.approx(0.006)
    assert stats["transfer"].total_s == 0.0


def test_a_fetch_that_found_no_batch_is_not_a_step() -> None:
    clock = FakeClock()
    timer = _timer(clock)
    _step(timer, {}, clock)
    fetching = timer.now()  # the epoch had no batch left
    timer.close_step(fetching)
    assert timer.steps == 1


def test_reset_starts_an_epoch_but_the_run_keeps_all_steps() -> None:
    clock = FakeClock()
    timer = _timer(clock)
    step = {"forward": 0.003, "optimizer": 0.001}
    _step(timer, step, clock)
    timer.reset()  # ends the open step: what runs before the next epoch is no step's
    clock.sleep(0.02)
    _step(timer, step, clock)
    _step(timer, step, clock)
    timer.close_step()
    assert timer.steps == 2
    assert timer.summary()["step"].total_s == pytest.approx(0.008)
    assert timer.summary(whole_run=True)["step"].total_s == pytest.approx(0.012)
    assert len(timer.summary(whole_run=True)) == len(PHASES) + 1
    assert timer.summary()["step"].total_s <= timer.summary(whole_run=True)["step"].total_s


def _stats(**shares: float) -> dict[str, PhaseStats]:
    stats = {
        p: PhaseStats(shares.get(p, 0.0), shares.get(p, 0.0), 0.0, shares.get(p, 0.0))
        for p in PHASES
    }
    stats["step"] = PhaseStats(1.0, 1.0, 1.0, 1.0)
    return stats


@pytest.mark.parametrize(
    ("shares", "expected"),
    [
        ({"data_wait": 0.5, "forward": 0.5}, "input-bound"),
        ({"data_wait": 0.1, "forward": 0.9}, "partly input-bound"),
        ({"data_wait": 0.01, "forward": 0.99}, "compute-bound"),
        ({"data_wait": 0.05, "transfer": 0.3, "forward": 0.65}, "transfer-bound"),
    ],
)
def test_verdicts(shares, expected) -> None:
    verdict = judge(_stats(**shares), num_workers=0, device_type="cuda")
    assert verdict.verdict == expected
    assert verdict.recommendation
    assert verdict.data_stall_pct == pytest.approx(100 * shares["data_wait"])


def test_input_bound_advice_names_workers_and_tune() -> None:
    verdict = judge(_stats(data_wait=0.6, forward=0.4), num_workers=0, device_type="cpu")
    assert "loader.num_workers" in verdict.recommendation
    assert "stoker tune" in verdict.recommendation


def test_summary_table_lines() -> None:
    summary = run_summary(
        _stats(data_wait=0.3, forward=0.7), num_workers=2, device_type="cpu", samples_per_s=1234.0
    )
    lines = summary_lines(summary)
    assert lines[0].split() == ["phase", "median", "ms", "p95", "ms", "share"]
    assert any(line.startswith("data_wait") and "30.0%" in line for line in lines)
    assert "verdict: input-bound" in lines[-2] and "1,234 samples/s" in lines[-2]


def test_system_monitor_reports_cpu_and_memory() -> None:
    monitor = SystemMonitor(torch.device("cpu"))
    wall_started, cpu_started = time.perf_counter(), time.process_time()
    deadline = cpu_started + 0.2
    while time.process_time() < deadline:  # busy for 0.2 s of this process's CPU time
        pass
    record = monitor.sample(num_workers=3)
    # What the process got of a core, measured alongside: on a machine busy with other
    # work it is less than one core, so the bar is the share it really had, not a constant.
    had_pct = 100 * (time.process_time() - cpu_started) / (time.perf_counter() - wall_started)
    assert record["system/cpu_pct"] == pytest.approx(had_pct, abs=10)
    assert record["system/cpu_pct"] > 5
    assert record["loader/num_workers"] == 3
    assert record["system/peak_rss_mib"] >= record["system/rss_mib"] * 0.5 > 0
    assert peak_rss_mib() > 10


def test_environment_names_versions() -> None:
    info = environment()
    assert info["torch"] == torch.__version__ and info["cpu_count"] >= 1
