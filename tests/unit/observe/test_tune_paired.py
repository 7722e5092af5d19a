"""The tuner's prediction from paired runs, the code changes it names, and the run's own
collate in its fetch figures."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from torch.utils.data import default_collate

from stoker.config import load_config
from stoker.observe.fetch_cost import FetchFigures
from stoker.observe.halving import Candidate
from stoker.observe.short_run import PipelineFigures
from stoker.observe.tune_plan import code_change_notes
from stoker.observe.tune_search import race
from stoker.train.pipeline import UserComponents


def figures(rate: float, *, steps: int, step_s: float, wait: float = 0.0) -> PipelineFigures:
    epoch_s = steps * step_s
    return PipelineFigures(
        samples_per_s=rate,
        data_wait_fraction=wait,
        steps=steps,
        epoch_s=epoch_s,
        data_wait_s=wait * epoch_s,
        startup_s=0.0,
        steady_samples_per_s=rate,
        steady_data_wait_fraction=wait,
        phases={"data_wait": wait},
        wall_s=epoch_s + 0.05,
    )


def test_race_predicts_from_the_fastest_paired_runs_in_alternating_order() -> None:
    # The configured settings train at 100 samples/s, the fused optimizer at 150, except
    # one configured run slowed to half by other load: the ratio of the means said 1.8x,
    # the fastest runs of the paired rounds say 1.5x, what the settings give.
    clock = [0.0]
    baseline, fused = Candidate(0), Candidate(0, fused=True)
    order: list[tuple[int, Candidate]] = []
    configured_runs = [0]

    def measure(candidate: Candidate, steps: int, until: float) -> PipelineFigures:
        rate = 150.0 if candidate == fused else 100.0
        if candidate == baseline:
            configured_runs[0] += 1
            if configured_runs[0] == 3:  # the last round's configured run, under load
                rate = 50.0
        order.append((len(order), candidate))
        step_s = 64 / rate
        clock[0] += 0.05 + steps * step_s
        return figures(rate, steps=steps, step_s=step_s)

    result = race(
        [fused],
        baseline,
        figures(100.0, steps=5, step_s=0.64),
        measure,
        deadline=60.0,
        epochs=1,
        epoch_steps=lambda c: 8,
        fewest=lambda c: 3,
        scale=lambda c: 1.0,
        clock=lambda: clock[0],
    )
    finals = [(run.round, run.candidate) for run in result.runs if run.round >= 2]
    # Round 2 runs the configured settings first, round 3 last, round 4 first again...
    assert finals == [
        (2, baseline),
        (2, fused),
        (3, fused),
        (3, baseline),
        (4, baseline),
        (4, fused),
        (5, fused),
        (5, baseline),
        (6, baseline),
        (6, fused),
    ]
    assert result.winner == fused
    assert result.gain == pytest.approx(1.5)


def _fetch(per_sample_s: float, collate_s: float | None) -> FetchFigures:
    return FetchFigures(per_sample_s, 1.0, collate_s, None, False)


def test_code_change_notes_name_the_doctors_code_change_when_the_run_waits_for_it() -> None:
    waiting = figures(1000.0, steps=10, step_s=0.064, wait=0.9)
    collate = code_change_notes(_fetch(6e-6, 160e-6), waiting, batched=False)
    assert len(collate) == 1 and "vectorise the collate_fn" in collate[0]
    assert "biggest gain needs a code change" in collate[0] and "160 µs" in collate[0]
    cheap = code_change_notes(_fetch(6e-6, 5e-6), waiting, batched=False)
    assert len(cheap) == 1 and "__getitems__" in cheap[0]
    # Batched already, or a run that hardly waits for data, or a costly dataset[i]:
    # no code change to name.
    assert code_change_notes(_fetch(6e-6, 5e-6), waiting, batched=True) == []
    fed = figures(1000.0, steps=10, step_s=0.064, wait=0.05)
    assert code_change_notes(_fetch(6e-6, 160e-6), fed, batched=False) == []
    assert code_change_notes(_fetch(2e-3, 5e-6), waiting, batched=False) == []
    assert code_change_notes(None, waiting, batched=False) == []


class _Stop(Exception):
    pass


def test_tune_times_the_runs_own_collate_fn(monkeypatch, tmp_path: Path) -> None:
    # A costly collate measured as default_collate's few µs asked for 1 worker where
    # the collate needed the cores (the expensive-collate scenario).
    from stoker.observe import tune as tune_module

    seen = []

    def measure_fetch(dataset, *, batch_size, collate_fn, seconds):
        seen.append(collate_fn)
        raise _Stop

    def my_collate(samples):
        return default_collate(samples)

    monkeypatch.setattr(tune_module, "measure_fetch", measure_fetch)
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: {name: mlp, args: {in_features: 64, out_features: 10, hidden: [16]}}\n"
        "data: {train: {name: digits}}\n"
        "loader: {batch_size: 64}\n"
        "train: {device: cpu}\n"
    )
    with pytest.raises(_Stop):
        tune_module.tune(
            load_config(path), budget_s=1.0, user=UserComponents(collate_fn=my_collate)
        )
    assert seen == [my_collate]


def _suite():
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "doctor_scenarios.py"
    name = "doctor_scenarios_under_test"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up while defined
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_suite_measures_realized_gains_as_paired_ratios_in_alternating_order(
    monkeypatch,
) -> None:
    suite = _suite()
    configured, tuned = suite._key({}), suite._key({"optim.fused": True})
    # Other load halves every run of the second round: the rates move, the ratios do not.
    calls: list[str] = []

    def real_rate(s, settings):
        calls.append(suite._key(settings))
        load = 0.5 if (len(calls) - 1) // 2 == 1 else 1.0
        return (300.0 if settings else 100.0) * load

    monkeypatch.setattr(suite, "real_rate", real_rate)
    rates = {configured: [90.0], tuned: [200.0]}
    ratios = suite.paired_ratios(None, [configured, tuned], rates, rounds=3)
    assert calls == [configured, tuned, tuned, configured, configured, tuned]
    assert ratios[tuned] == [3.0, 3.0, 3.0] and ratios[configured] == [1.0, 1.0, 1.0]
    assert rates[configured] == [90.0, 100.0, 50.0, 100.0]


def test_suite_states_tunes_share_of_the_best_and_of_the_best_by_config_alone() -> None:
    suite = _suite()
    assert suite._code(suite._key({"code.collate": "fast_collate"}))
    assert not suite._code(suite._key({"loader.num_workers": 2}))
    rows = [
        # The best is a code change, config alone finds nothing: no config gain to find.
        {"advice_share": 1.0, "tune_share": 0.0, "tune_share_config": None},
        # The best is a code change; tune reaches 90% of the best by config.
        {"advice_share": 1.0, "tune_share": 0.3, "tune_share_config": 0.9},
        {"advice_share": 1.0, "tune_share": 1.0, "tune_share_config": 1.0},
    ]
    for row in rows:
        row.update(verdict_ok=True, tune_error=0.0, tune_s=1.0, yaml_kept=True)
    totals = suite.summary(rows, 8.0)
    assert totals["with_gain"] == 3 and totals["tune_reaches_80pct"] == 1
    assert totals["with_config_gain"] == 2
    assert totals["tune_reaches_80pct_of_config_best"] == 2


def test_suite_applies_the_code_change_without_the_cache_it_stands_in_for(tmp_path) -> None:
    from types import SimpleNamespace

    suite = _suite()
    listed = suite.scenarios(tmp_path, 2)
    scenario = next(s for s in listed if s.name == "per_sample_in_memory")
    batched = next(p for p in scenario.space if "code.data" in p)
    stand_in = SimpleNamespace(
        settings={"data.cache": "memory", "train.threads": 1},
        code_advice=[
            "fetch whole batches: give the dataset a __getitems__(indices) ...; "
            "with no code change, data.cache=memory reads a deterministic dataset"
        ],
    )
    assert suite.applied_advice(scenario, stand_in) == {"train.threads": 1, **batched}
    both = SimpleNamespace(
        settings={"data.cache": "memory"}, code_advice=["fetch whole batches (__getitems__)"]
    )
    assert suite.applied_advice(scenario, both) == {"data.cache": "memory", **batched}


def test_two_rounds_with_one_loaded_run_predict_the_unloaded_ratio() -> None:
    # Two rounds (a median is then the mean): the configured settings once at half speed.
    from types import SimpleNamespace as Run

    from stoker.observe.tune_plan import paired_gains

    base, cache = Candidate(0), Candidate(0, cache="memory")
    finals = {
        base: [Run(round=2, rate=23350.0), Run(round=3, rate=12345.0)],
        cache: [Run(round=2, rate=19429.0), Run(round=3, rate=19589.0)],
        Candidate(2): [Run(round=4, rate=99999.0)],  # no configured run in its round
    }
    gains = paired_gains(finals, base)
    assert gains[base] == 1.0 and Candidate(2) not in gains
    assert gains[cache] == pytest.approx(19589.0 / 23350.0)


def test_likely_workers_pay_a_persistent_workers_start_over_the_runs_epochs() -> None:
    from stoker.observe.tune_plan import likely_workers

    # 64 fetches of 1 ms (5% CPU: a wait) per batch against 4 ms of compute: 16 workers
    # keep up; 32 batches an epoch allow 8 at 4 batches each, 2 epochs allow 16.
    calibration = dataclasses.replace(
        figures(640.0, steps=10, step_s=0.04),
        phases={"forward": 0.05, "backward": 0.04, "optimizer": 0.01, "data_wait": 0.9},
    )
    waits = FetchFigures(0.001, 0.05, None, None, False)
    kwargs = {"batch_size": 64, "cores": 2, "cap": 16, "batches": 32}
    assert likely_workers(waits, calibration, **kwargs) == 8
    assert likely_workers(waits, calibration, **kwargs, epochs=2) == 16


def test_a_candidate_that_collapses_in_one_paired_round_is_no_gain() -> None:
    # Two intra-op threads on a busy 2-core machine (the suite's heavy model): faster in
    # two rounds, then at 6% of the configured rate; whole runs trained at 0.06x.
    from types import SimpleNamespace as Run

    from stoker.observe.tune_plan import paired_gains

    base, threads = Candidate(0), Candidate(0, threads=2)
    finals = {
        base: [Run(round=2, rate=4099.0), Run(round=3, rate=4057.0), Run(round=4, rate=4128.0)],
        threads: [Run(round=2, rate=5072.0), Run(round=3, rate=5416.0), Run(round=4, rate=232.0)],
    }
    gains = paired_gains(finals, base)
    assert gains[threads] == pytest.approx(232.0 / 4128.0)
    # Ordinary noise (a round at 0.8x): three rounds predict their median ratio.
    finals[threads][2] = Run(round=4, rate=3300.0)
    assert paired_gains(finals, base)[threads] == pytest.approx(5072.0 / 4099.0)
    # Two rounds: the fastest run over the configured settings' fastest.
    two = {base: finals[base][:2], threads: finals[threads][:2]}
    assert paired_gains(two, base)[threads] == pytest.approx(5416.0 / 4099.0)
