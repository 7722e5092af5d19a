"""Phase timers, the run verdict and system metrics."""

from __future__ import annotations

import time

import pytest
import torch

from stoker.observe.system import SystemMonitor, environment, peak_rss_mib
from stoker.observe.timing import PHASES, PhaseStats, PhaseTimer, timing_record
from stoker.observe.verdict import judge, run_summary, summary_lines


def _step(timer: PhaseTimer, waits: dict[str, float]) -> None:
    """One step as the loop times it: a reading at each phase's end, handed over at once."""
    fetching = timer.now()
    time.sleep(waits.get("data_wait", 0))
    readings = [fetching, timer.now()]
    for phase in PHASES[1:-1]:
        time.sleep(waits.get(phase, 0))
        if phase == "transfer" and not timer.times_transfer:  # as the loop: no copy on the CPU
            readings.append(readings[-1])
        else:
            readings.append(timer.now())
    timer.record(tuple(readings))
    time.sleep(waits.get("optimizer", 0))  # the optimizer phase ends at the next fetch


def test_phase_timer_attributes_time_to_the_right_phase() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    for _ in range(3):
        _step(timer, {"data_wait": 0.06, "backward": 0.03, "optimizer": 0.012})
    timer.close_step()
    stats = timer.summary()
    assert timer.steps == 3
    # A sleep never ends early, so each phase holds at least its sleep; a busy machine
    # only adds to it. The upper bound leaves 11 ms for that and still catches any
    # neighbour's sleep (>= 12 ms) counted in the wrong phase.
    for phase, slept in {"data_wait": 0.06, "backward": 0.03, "optimizer": 0.012}.items():
        assert slept <= stats[phase].median_s < slept + 0.011, phase
    assert stats["data_wait"].share > stats["forward"].share
    assert sum(stats[p].share for p in PHASES) == pytest.approx(1.0)
    record = timing_record(stats)
    assert record["time/data_stall_pct"] == pytest.approx(100 * stats["data_wait"].share)
    assert set(record) >= {f"time/{p}_s" for p in PHASES} | {"time/step_s", "time/step_p95_s"}


def test_laps_add_up_over_micro_batches() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    readings = [timer.now(), timer.now()]
    for _ in range(3):  # three micro-batches, in the loop's order
        transferred = readings[-1]  # no copy on the CPU: no reading either
        time.sleep(0.005)
        readings += (transferred, timer.now(), timer.now())
    timer.record(tuple(readings))
    timer.close_step()
    stats = timer.summary()
    assert stats["forward"].total_s >= 0.015
    assert stats["backward"].total_s < 0.005 and stats["transfer"].total_s == 0.0


def test_a_fetch_that_found_no_batch_is_not_a_step() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    _step(timer, {})
    fetching = timer.now()  # the epoch had no batch left
    timer.close_step(fetching)
    assert timer.steps == 1


def test_reset_starts_an_epoch_but_the_run_keeps_all_steps() -> None:
    timer = PhaseTimer(torch.device("cpu"))
    _step(timer, {})
    timer.reset()  # ends the open step: what runs before the next epoch is no step's
    time.sleep(0.02)
    _step(timer, {})
    _step(timer, {})
    timer.close_step()
    assert timer.steps == 2
    assert timer.summary(whole_run=True)["step"].total_s < 0.02
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
