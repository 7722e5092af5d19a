"""The tuner's race: the doctor's other changes as candidates, their order, the plan of
each short run against the budget, the race on fake runs, and writing every key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from stoker.config import load_config
from stoker.errors import ConfigError
from stoker.observe.fetch_cost import FetchFigures
from stoker.observe.halving import Candidate, likeliest_first, search_space, successive_halving
from stoker.observe.short_run import PipelineFigures
from stoker.observe.tune_plan import cache_first, likely_workers, run_steps
from stoker.observe.tune_search import (
    Facts,
    other_changes,
    race,
    shortlist,
)
from stoker.observe.yaml_edit import write_settings

FACTS = Facts(
    device="cpu",
    cores=2,
    workers=0,
    threads=2,
    optimizer="adamw",
    fused=False,
    cache="none",
    length=1000,
    in_memory=False,
    per_sample_s=0.001,
    sample_bytes=1024,
    free_bytes=2**33,
    epochs=2,
    left_s=8.0,
)


def test_other_changes_are_the_doctors_kinds_where_they_apply() -> None:
    found, notes = other_changes(FACTS)
    assert found == [{"cache": "memory"}, {"fused": True}, {"threads": 1}]
    assert notes == []
    # With a worker, the thread counts tried are 1 and the cores per process.
    found, _ = other_changes(dataclasses.replace(FACTS, workers=1, threads=4))
    assert {"threads": 1} in found and {"threads": 2} not in found
    found, _ = other_changes(dataclasses.replace(FACTS, threads=1, cores=4))
    assert [c for c in found if "threads" in c] == [{"threads": 4}]
    # Nothing to fuse, nothing to cache, no intra-op threads to tune on a GPU.
    quiet = dataclasses.replace(FACTS, fused=True, cache="memory", device="cuda")
    assert other_changes(quiet) == ([], [])
    assert other_changes(dataclasses.replace(quiet, fused=False, optimizer="sgd")) == ([], [])
    assert other_changes(dataclasses.replace(quiet, cache="none", in_memory=True))[0] == []
    assert other_changes(dataclasses.replace(quiet, cache="none", length=None))[0] == []


def test_a_cache_is_tried_only_when_its_fill_fits_the_budget_and_memory() -> None:
    # One epoch of costly samples: the fill costs what the epoch would; not tried.
    one_epoch = dataclasses.replace(FACTS, epochs=1)
    assert {"cache": "memory"} not in other_changes(one_epoch)[0]
    # One epoch of cheap samples: read into arrays once, served a batch at a time.
    cheap = dataclasses.replace(one_epoch, per_sample_s=5e-6)
    assert {"cache": "memory"} in other_changes(cheap)[0]
    slow = dataclasses.replace(FACTS, per_sample_s=0.01, length=100_000)  # 1,000 s to fill
    found, notes = other_changes(slow)
    assert {"cache": "memory"} not in found
    assert "data.cache=memory not tried" in notes[0] and "--budget-s" in notes[0]
    big = dataclasses.replace(FACTS, sample_bytes=2**30, free_bytes=2**32)
    found, notes = other_changes(big)
    assert {"cache": "memory"} not in found and "GiB" in notes[0]


def test_shortlist_pairs_changes_with_the_loader_settings_and_orders_by_the_phase_table() -> None:
    baseline = Candidate(3)
    ranked = [Candidate(2), Candidate(4), baseline, Candidate(0), Candidate(1)]
    changes = [{"cache": "memory"}, {"fused": True}, {"threads": 1}]
    phases = {"data_wait": 0.1, "forward": 0.1, "backward": 0.1, "optimizer": 0.7}
    found = shortlist(ranked, baseline, changes, phases=phases)
    assert baseline not in found
    # The two best loader candidates, and the best one without workers.
    assert {Candidate(2), Candidate(4), Candidate(0)} <= set(found)
    # Each change on the configured loader settings and on the best loader candidate;
    # a cache with the workers off (the cached samples are served in-process).
    assert Candidate(3, fused=True) in found and Candidate(2, fused=True) in found
    assert Candidate(0, cache="memory") in found
    assert Candidate(3, threads=1) in found and Candidate(2, threads=1) in found
    # The optimizer takes half the step: the fused kernel first, data wait last.
    assert found[0] == Candidate(3, fused=True)
    assert found.index(Candidate(3, threads=1)) < found.index(Candidate(2))
    waiting = shortlist(ranked, baseline, changes, phases={"data_wait": 0.9, "forward": 0.1})
    assert waiting[0] in {Candidate(2), Candidate(0, cache="memory")}


def test_run_steps_plans_whole_epochs_when_one_fits_and_nothing_when_too_little_is_left() -> None:
    plan = {"overhead_s": 0.3, "step_s": 0.01, "fewest": 10, "epoch_steps": 40, "epochs": 3}
    assert run_steps(0.3 + 0.5, **plan) == 40  # 50 steps fit: one whole epoch
    assert run_steps(0.3 + 1.0, **plan) == 80  # 100 fit: two whole epochs
    assert run_steps(0.3 + 9.0, **plan) == 120  # never more than the run's 3 epochs
    assert run_steps(0.3 + 0.25, **plan) == 25  # less than an epoch: what fits
    assert run_steps(0.3 + 0.05, **plan) is None  # not even the fewest steps
    assert run_steps(1.0, **{**plan, "epoch_steps": None}) == 70  # a stream


def figures(rate: float, *, steps: int, step_s: float, overhead_s: float) -> PipelineFigures:
    epoch_s = steps * step_s
    return PipelineFigures(
        samples_per_s=rate,
        data_wait_fraction=0.0,
        steps=steps,
        epoch_s=epoch_s,
        data_wait_s=0.0,
        startup_s=0.0,
        steady_samples_per_s=rate,
        steady_data_wait_fraction=0.0,
        wall_s=epoch_s + overhead_s,
    )


def race_on(
    clock: list[float],
    candidates: list[Candidate],
    baseline: Candidate,
    calibration: PipelineFigures,
    measure,
    *,
    deadline: float,
    epochs: int = 1,
    fewest: int = 3,
    scale=lambda c: 1.0,
):
    """``race`` on a fake clock (``clock[0]``), epochs of unknown length, ``fewest`` steps."""
    return race(
        candidates,
        baseline,
        calibration,
        measure,
        deadline=deadline,
        epochs=epochs,
        epoch_steps=lambda c: None,
        fewest=lambda c: fewest,
        scale=scale,
        clock=lambda: clock[0],
    )


def test_race_keeps_to_its_deadline_and_compares_the_winner_in_the_same_round() -> None:
    clock = [0.0]
    baseline = Candidate(0)
    fused, threads, workers = Candidate(0, fused=True), Candidate(0, threads=1), Candidate(2)
    rates = {baseline: 100.0, fused: 150.0, threads: 120.0, workers: 90.0}
    calls: list[tuple[Candidate, int]] = []

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        calls.append((candidate, steps))
        rate = rates.get(candidate, 170.0)  # the two winners together
        step_s = 64 / rate
        clock[0] += 0.3 + steps * step_s  # every run pays 0.3 s besides its steps
        return figures(rate, steps=steps, step_s=step_s, overhead_s=0.3)

    calibration = figures(100.0, steps=5, step_s=0.64, overhead_s=0.3)
    result = race_on(
        clock, [fused, threads, workers], baseline, calibration, measure, deadline=30.0, epochs=2
    )
    assert clock[0] <= 30.0
    together = Candidate(0, fused=True, threads=1)
    assert together in [c for c, _ in calls]  # two changes won: tried together
    assert result.winner == together
    # The last round measured the configured settings again beside the finalists.
    last = [run for run in result.runs if run.round >= 2]
    assert last[0].candidate == baseline and last[1].candidate == together
    assert result.gain == pytest.approx(1.7)
    assert result.baseline_figures is last[-2].figures


def test_race_skips_runs_that_do_not_fit() -> None:
    clock = [0.0]

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        clock[0] += 0.3 + steps * 0.5
        return figures(128.0, steps=steps, step_s=0.5, overhead_s=0.3)

    calibration = figures(128.0, steps=5, step_s=0.5, overhead_s=0.3)
    candidates = [Candidate(w) for w in (1, 2, 3, 4)]
    result = race_on(clock, candidates, Candidate(0), calibration, measure, deadline=4.0)
    assert clock[0] <= 4.0
    assert result.dropped  # 4 runs of at least 1.8 s cannot fit in 4 s
    assert result.gain == pytest.approx(1.0)


def test_halving_starts_no_measurement_that_would_end_past_its_deadline() -> None:
    clock = [0.0]
    candidates = [Candidate(w) for w in range(8)]

    def measure(candidate: Candidate, seconds: float) -> float:
        clock[0] += seconds + 1.0  # start-up and shutdown: 1 s a measurement
        return 100.0 + candidate.num_workers

    result = successive_halving(
        candidates, measure, final_s=1.6, deadline_s=5.0, clock=lambda: clock[0]
    )
    assert clock[0] <= 5.0
    assert len(result.trials) == 4


def test_candidate_settings_and_label_carry_the_other_changes() -> None:
    candidate = Candidate(2, cache="memory", fused=True, threads=1)
    assert candidate.settings() == {"data.cache": "memory", "optim.fused": True, "train.threads": 1}
    assert "data.cache=memory" in candidate.label() and "optim.fused=true" in candidate.label()
    assert candidate.loader() == Candidate(2)
    assert Candidate(2).settings() == {}
    assert Candidate(2).cost() < candidate.cost()  # fewer changes first among equals


def test_run_rate_from_whole_epochs_pays_each_epochs_start_up_as_a_real_run() -> None:
    base = dataclasses.replace(
        figures(1000.0, steps=10, step_s=0.064, overhead_s=0.3), epoch_samples=640
    )
    # Two whole epochs measured: the run of two is exactly their time, plus a cache fill.
    two = dataclasses.replace(base, epoch_times=(1.0, 0.6), prepare_s=0.4)
    assert two.run_rate(2) == pytest.approx(2 * 640 / (0.4 + 1.6))
    # Three epochs from two: the later ones at the second's time.
    assert two.run_rate(3) == pytest.approx(3 * 640 / (0.4 + 1.0 + 0.6 + 0.6))
    # One epoch without persistent workers: every epoch pays its start-up again.
    one = dataclasses.replace(base, epoch_times=(1.0,))
    assert one.run_rate(2) == pytest.approx(2 * 640 / 2.0)


CONFIG = """\
# tuned by stoker
model: {name: mlp}  # the model
data: {train: {name: digits}}
loader: {batch_size: 64}  # flow style
optim:
  lr: 0.01  # keep
train:
  device: cpu
"""


def test_write_settings_writes_every_key_of_the_winner_keeping_comments_and_style(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    changes = write_settings(
        path,
        {
            "loader.num_workers": 2,
            "data.cache": "memory",
            "optim.fused": True,
            "train.threads": 1,
        },
    )
    assert changes == {
        "loader.num_workers": (0, 2),
        "data.cache": ("none", "memory"),
        "optim.fused": ("auto", True),
        "train.threads": ("auto", 1),
    }
    text = path.read_text()
    lines = text.splitlines()
    assert lines[0] == "# tuned by stoker" and lines[1] == "model: {name: mlp}  # the model"
    assert lines[2].startswith("data: {train: {name: digits}, cache: memory}")
    assert lines[3].startswith("loader: {batch_size: 64, num_workers: 2}")
    assert lines[3].endswith("# flow style")
    assert "  lr: 0.01  # keep" in lines and "  fused: true" in lines
    assert "  threads: 1" in lines
    config = load_config(path)
    assert config.data.cache == "memory" and config.optim.fused is True
    assert config.train.threads == 1 and config.loader.num_workers == 2
    assert yaml.safe_load(text)["model"] == {"name": "mlp"}
    with pytest.raises(ConfigError, match="not a optim setting"):
        write_settings(path, {"optim.fuse": True})
    with pytest.raises(ConfigError, match="not a setting stoker can write"):
        write_settings(path, {"model.name": "x"})


def test_likely_workers_keep_up_with_the_step_past_the_cores_when_the_fetch_waits() -> None:
    # 64 fetches of 1 ms per batch against 10 ms of compute: 7 workers keep up.
    calibration = dataclasses.replace(
        figures(640.0, steps=10, step_s=0.1, overhead_s=0.0),
        phases={"forward": 0.05, "backward": 0.04, "optimizer": 0.01, "data_wait": 0.9},
    )
    waits = FetchFigures(0.001, 0.05, None, None, False)  # 5% CPU: an I/O wait
    busy = dataclasses.replace(waits, cpu_share=1.0)
    kwargs = {"batch_size": 64, "cores": 2, "cap": 16}
    assert likely_workers(waits, calibration, **kwargs) == 7
    assert likely_workers(busy, calibration, **kwargs) == 2  # CPU-bound: no more than cores
    # Each worker pays its start back over at least 4 batches of the epoch.
    assert likely_workers(waits, calibration, **kwargs, batches=12) == 3
    assert likely_workers(None, calibration, **kwargs) is None


def test_likeliest_first_measures_the_likely_count_and_its_neighbours_first() -> None:
    space = search_space(cores=2, baseline=Candidate(2), cuda=False, batched=False, cpu_share=0.05)
    ordered = likeliest_first(space, 8)
    assert sorted(ordered, key=repr) == sorted({*space, Candidate(8, None, True)}, key=repr)
    assert ordered[:3] == [Candidate(2), Candidate(8), Candidate(8, None, True)]
    counts = [c.num_workers for c in ordered[3:8]]
    assert counts[:2] in ([4, 16], [16, 4])  # the neighbours before 0, 1, 2
    assert likeliest_first(space, 8) != space  # before: 0, 1, 2, 3 first


def test_race_runs_the_likeliest_candidate_when_its_screen_share_is_too_short() -> None:
    clock = [0.0]
    fast, slow = Candidate(8, persistent_workers=True), Candidate(16)

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        rate = 300.0 if candidate == fast else 100.0
        clock[0] += 0.3 + steps * 64 / rate
        return figures(rate, steps=steps, step_s=64 / rate, overhead_s=0.3)

    calibration = figures(100.0, steps=5, step_s=0.64, overhead_s=0.3)
    result = race_on(clock, [fast, slow], Candidate(2), calibration, measure, deadline=4.0)
    # The screen (55% of 4 s) is short of 3 steps and the start (2.2 s): before, both were
    # dropped and the configured settings raced alone; now the first gets the time left.
    assert fast not in result.dropped and slow in result.dropped
    assert result.winner == fast


def test_race_repeats_a_final_round_only_as_long_as_the_last() -> None:
    clock = [0.0]
    baseline, fused = Candidate(0), Candidate(0, fused=True)

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        step_s = 0.1 if candidate == baseline else 0.05
        clock[0] += 0.05 + steps * step_s / 2  # runs take half the time planned
        return figures(64 / step_s, steps=steps, step_s=step_s, overhead_s=0.05)

    result = race_on(
        clock,
        [fused],
        baseline,
        figures(640.0, steps=5, step_s=0.1, overhead_s=0.05),
        measure,
        deadline=10.0,
    )
    finals = [run for run in result.runs if run.round >= 2]
    # 3.2 s were left after the second round: room for 15 and 31 steps, shorter than its
    # 42 and 128; such runs weigh fixed costs more and are not averaged in.
    assert [run.round for run in finals] == [2, 2]


def test_race_predicts_from_each_candidates_longest_run_when_the_baseline_cannot_rerun() -> None:
    clock = [0.0]
    baseline, workers = Candidate(2), Candidate(8, persistent_workers=True)

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        clock[0] += 0.3 + steps * 0.05
        rate = 200.0 if steps < 10 else 400.0  # a short run is mostly its workers' start
        return figures(rate, steps=steps, step_s=0.05, overhead_s=0.3)

    result = race(
        [workers],
        baseline,
        figures(100.0, steps=5, step_s=2.0, overhead_s=0.3),  # 3 steps take 6 s
        measure,
        deadline=2.2,
        epochs=1,
        epoch_steps=lambda c: None,
        fewest=lambda c: 3,
        scale=lambda c: 0.25 if c == workers else 1.0,
        clock=lambda: clock[0],
    )
    assert [(run.round, run.figures.steps) for run in result.runs[1:]] == [(1, 3), (2, 28)]
    # Before: the screening run's 200 samples/s decided (2x); the 28-step run shows 4x.
    assert result.winner == workers
    assert result.gain == pytest.approx(4.0)
    assert result.winner_figures.steps == 28


def test_race_reruns_the_configured_settings_at_their_fewest_steps_in_the_last_round() -> None:
    clock = [0.0]
    baseline, workers = Candidate(0), Candidate(2, persistent_workers=True)

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        step_s = 0.1 if candidate == baseline else 0.05
        clock[0] += 0.3 + steps * step_s
        return figures(64 / step_s, steps=steps, step_s=step_s, overhead_s=0.3)

    # The calibration, the process's first run, took 0.3 s a step (one-off costs).
    result = race_on(
        clock,
        [workers],
        baseline,
        figures(213.0, steps=5, step_s=0.3, overhead_s=0.3),
        measure,
        deadline=2.6,
    )
    reruns = [run for run in result.runs if run.round == 2 and run.candidate == baseline]
    # Its equal share (1.1 s) held no 3 steps at the calibration's 0.3 s; before, the
    # calibration's 213 samples/s was the reference (6x); at its own 640, 2x.
    assert reruns and reruns[0].figures.steps >= 3
    assert result.gain == pytest.approx(2.0)


def test_a_race_run_is_stopped_at_half_again_its_share() -> None:
    clock = [0.0]
    slow = Candidate(0, threads=2)
    ends: list[float] = []

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        ends.append(until - clock[0])
        clock[0] = until if candidate == slow else clock[0] + 0.3 + steps * 0.1
        return figures(64.0, steps=steps, step_s=0.1, overhead_s=0.3)

    race_on(
        clock,
        [slow, Candidate(0, fused=True)],
        Candidate(0),
        figures(640.0, steps=5, step_s=0.1, overhead_s=0.3),
        measure,
        deadline=20.0,
    )
    # The screen's share is 55% of 20 s over 2: 5.5 s; before, the run could take all 20.
    assert ends[0] == pytest.approx(1.5 * 5.5)


def test_a_cache_is_raced_first_when_its_estimate_beats_the_best_loader() -> None:
    # Too many CPU-bound workers: 570 samples/s, 85% data wait, 1,024 samples at 0.4 ms.
    calibration = dataclasses.replace(
        figures(570.0, steps=10, step_s=64 / 570, overhead_s=0.0),
        phases={"data_wait": 0.85, "forward": 0.1, "optimizer": 0.05},
    )
    cpu_bound = FetchFigures(0.0004, 1.0, None, None, False, fill_per_sample_s=0.0004)
    kwargs = {"length": 1024, "epochs": 2}
    # Cached: 3.6 s of epochs become a 0.4 s fill and 0.5 s; 2 workers reach ~1,300/s.
    assert cache_first(cpu_bound, calibration, **kwargs, loader_rate=1_300.0)
    # A loader alone 3x faster, against a fill that costs most of an epoch: loader first.
    waits = dataclasses.replace(cpu_bound, fill_per_sample_s=0.0015)
    assert not cache_first(waits, calibration, **kwargs, loader_rate=1_800.0)
    assert not cache_first(None, calibration, **kwargs, loader_rate=1_300.0)
    ranked, changes = [Candidate(2), Candidate(8)], [{"cache": "memory"}]
    phases = {"data_wait": 0.85}
    first = shortlist(ranked, Candidate(8), changes, phases=phases, cache_first=True)
    assert first[0] == Candidate(0, cache="memory")
    assert shortlist(ranked, Candidate(8), changes, phases=phases)[0] == Candidate(2)


def test_without_a_whole_last_round_the_configured_settings_latest_run_is_the_reference() -> None:
    clock = [0.0]
    baseline, fused = Candidate(0), Candidate(0, fused=True)

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        if candidate == baseline:  # the machine got busier: it runs to its end, at half speed
            clock[0] = until
            return figures(320.0, steps=steps, step_s=0.2, overhead_s=0.3)
        clock[0] += 0.3 + steps * 64 / 960
        return figures(960.0, steps=steps, step_s=64 / 960, overhead_s=0.3)

    result = race_on(
        clock,
        [fused],
        baseline,
        figures(640.0, steps=5, step_s=0.1, overhead_s=0.3),
        measure,
        deadline=4.0,
        fewest=5,
    )
    assert [(r.candidate == fused, r.round) for r in result.runs[1:]] == [(True, 1), (False, 2)]
    # Before: against the calibration (640), 1.5x; against the later run beside it, 3x.
    assert result.gain == pytest.approx(3.0)
    assert result.baseline_figures.samples_per_s == 320.0
