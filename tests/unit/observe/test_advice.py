"""The doctor's verdict and proposals on synthetic stage figures (no timing), and how the
short confirming runs settle which change is recommended."""

from __future__ import annotations

import dataclasses

import pytest

from stoker.observe.advice import MIN_GAIN, diagnose, settle
from stoker.observe.measurements import Measurements
from stoker.observe.short_run import PipelineFigures, startup_wait
from stoker.observe.stages import FetchFigures, LoaderPoint


def pipeline(rate: float, wait: float, **phases: float) -> PipelineFigures:
    return PipelineFigures(
        samples_per_s=rate,
        data_wait_fraction=wait,
        steps=20,
        epoch_s=1.0,
        data_wait_s=wait,
        startup_s=0.0,
        steady_samples_per_s=rate,
        steady_data_wait_fraction=wait,
        phases=phases,
    )


def points(**rates: float) -> tuple[LoaderPoint, ...]:
    return tuple(LoaderPoint(int(k[1:]), r, 0.1, (r, r, r)) for k, r in rates.items())


def fetch(per_sample_s: float, cpu_share: float = 0.9, **changes) -> FetchFigures:
    figures = FetchFigures(
        per_sample_s=per_sample_s,
        cpu_share=cpu_share,
        collate_per_sample_s=0.5e-6,
        batched_per_sample_s=None,
        supports_batched=False,
    )
    return dataclasses.replace(figures, **changes)


def measured(**changes) -> Measurements:
    base = Measurements(
        device="cpu",
        cores=2,
        torch_threads=1,
        batch_size=64,
        num_workers=0,
        pin_memory=False,
        returns_batches=False,
        seconds=1.0,
        loader=points(w0=100_000, w1=60_000, w2=100_000, w3=100_000),
        compute_samples_per_s=5_000.0,
        pipeline=pipeline(4_700.0, 0.01),
        fetch=fetch(5e-6),
        compute_shares=(0.4, 0.5, 0.1),
    )
    return dataclasses.replace(base, **changes)


def test_an_expensive_collate_is_collate_bound_and_workers_spread_it() -> None:
    # dataset[i] 5 µs, collate 150 µs per sample: the loader's 6,000 samples/s is collate.
    diagnosis = diagnose(
        measured(
            loader=points(w0=6_000, w1=5_900, w2=11_000, w3=11_500),
            compute_samples_per_s=60_000.0,
            pipeline=pipeline(5_500.0, 0.85),
            fetch=fetch(5e-6, collate_per_sample_s=150e-6),
        )
    )
    assert diagnosis.verdict == "collate-bound"
    assert "collate_fn takes 150.0 µs per sample" in diagnosis.reason
    # Workers are the setting that spreads collate over cores: 2 (within 5% of 3).
    assert diagnosis.settings == {"loader.num_workers": 2}
    assert "vectorise the collate_fn" in diagnosis.code_advice[0]
    assert "NOT add workers" not in diagnosis.recommendation


def test_a_cheap_collate_is_not_collate_bound() -> None:
    diagnosis = diagnose(
        measured(
            loader=points(w0=100_000, w1=38_000),
            compute_samples_per_s=130_000.0,
            pipeline=pipeline(30_000.0, 0.5),
            fetch=fetch(4e-6, collate_per_sample_s=0.5e-6, batched_per_sample_s=0.3e-6),
            returns_batches=True,
        )
    )
    assert diagnosis.verdict == "input-bound"


def test_a_non_fused_optimizer_that_takes_most_of_the_step_gets_optim_fused() -> None:
    diagnosis = diagnose(
        measured(
            compute_shares=(0.2, 0.16, 0.64),
            fused=False,
            fused_samples_per_s=11_000.0,
        )
    )
    assert diagnosis.verdict == "optimizer-bound"
    assert diagnosis.bottleneck == "compute"
    assert "64% of compute" in diagnosis.reason
    assert diagnosis.settings == {"optim.fused": True}
    # No workers: loading and compute add up, 1 / (1/100,000 + 1/11,000) = 9,910.
    assert diagnosis.expected_gain == pytest.approx(1 / (1 / 100_000 + 1 / 11_000) / 4_700)


def test_sgd_over_many_tensors_gets_code_advice_not_a_setting() -> None:
    diagnosis = diagnose(measured(compute_shares=(0.2, 0.2, 0.6), optimizer="sgd", fused=False))
    assert diagnosis.verdict == "optimizer-bound"
    assert diagnosis.settings == {}
    assert "foreach=True" in diagnosis.code_advice[0]


def test_compute_faster_at_fewer_threads_is_thread_oversubscription() -> None:
    diagnosis = diagnose(
        measured(torch_threads=8, thread_rates={1: 40_000.0, 2: 30_000.0}, num_workers=1)
    )
    assert diagnosis.verdict == "threads-oversubscribed"
    assert diagnosis.settings == {"train.threads": 1}
    assert "8.0x faster at 1 intra-op thread(s) than at 8" in diagnosis.reason


def test_compute_faster_at_more_threads_is_a_change_not_oversubscription() -> None:
    """One thread (OMP_NUM_THREADS=1) on 2 free cores: more threads are proposed, and the
    verdict stays compute-bound."""
    diagnosis = diagnose(
        measured(
            torch_threads=1,
            thread_rates={2: 8_000.0},
            loader=points(w0=5_000_000),
            pipeline=pipeline(4_950.0, 0.0),
        )
    )
    assert diagnosis.verdict == "compute-bound"
    assert diagnosis.settings == {"train.threads": 2}
    assert "at 2 intra-op thread(s) vs 5,000 at 1" in diagnosis.recommendation
    assert "cores the loader leaves free sit unused" in diagnosis.recommendation
    assert diagnosis.expected_gain == pytest.approx(8_000 / 4_950, rel=0.02)


def test_a_thread_count_slower_alone_is_never_proposed() -> None:
    """The pipeline runs under its ceilings' prediction; a thread count whose compute is
    slower alone must not take credit for that gap."""
    slower = measured(
        torch_threads=1,
        thread_rates={2: 222_000.0},
        loader=points(w0=30_000),
        compute_samples_per_s=246_000.0,
        pipeline=pipeline(22_500.0, 0.8),
    )
    assert all("train.threads" not in c.settings for c in diagnose(slower).changes)
    faster = dataclasses.replace(slower, thread_rates={2: 400_000.0})
    assert any(c.settings == {"train.threads": 2} for c in diagnose(faster).changes)


def test_a_run_whose_loader_and_compute_are_close_is_balanced_with_nothing_to_set() -> None:
    diagnosis = diagnose(
        measured(
            num_workers=4,
            loader=points(w0=900, w2=2_000, w4=4_000, w8=7_000),
            compute_samples_per_s=3_200.0,
            pipeline=pipeline(3_100.0, 0.02),
            fetch=fetch(1e-3, cpu_share=0.05),
        )
    )
    assert diagnosis.verdict == "balanced"
    assert diagnosis.settings == {}  # 8 workers: min(7000, 3200) is no faster than 3100
    assert "no setting stoker can change" in diagnosis.recommendation


def test_a_wait_over_20pct_with_a_loader_that_keeps_up_and_nothing_faster_is_balanced() -> None:
    # Loader alone 3,098 vs compute 2,720 samples/s; the pipeline waits 21% of the time.
    diagnosis = diagnose(
        measured(
            num_workers=4,
            loader=points(w0=900, w2=1_600, w4=3_098, w8=5_000),
            compute_samples_per_s=2_720.0,
            pipeline=pipeline(2_368.0, 0.21),
            fetch=fetch(1e-3, cpu_share=0.07),
        )
    )
    assert diagnosis.verdict == "input-bound"  # by the wait alone, before the short runs
    settled = settle(diagnosis, {c.label(): 1.01 for c in diagnosis.changes})
    assert settled.verdict == "balanced" and settled.bottleneck == "compute"
    assert "keeps up with compute (3,098 vs 2,720" in settled.reason
    # A loader 5% under compute, an 11% wait, nothing faster: balanced too.
    close = diagnose(
        measured(
            num_workers=4,
            loader=points(w0=900, w2=1_600, w4=2_747, w8=2_800),
            compute_samples_per_s=2_880.0,
            pipeline=pipeline(2_573.0, 0.11),
            fetch=fetch(1.1e-3, cpu_share=0.06),
        )
    )
    assert close.verdict == "partly input-bound"
    settled = settle(close, {c.label(): 1.0 for c in close.changes})
    assert settled.verdict == "balanced"
    assert "all but keeps up with compute (2,747 vs 2,880" in settled.reason
    # A loader slower than compute stays the bottleneck, confirmed or not.
    slow = diagnose(measured(loader=points(w0=1_000), pipeline=pipeline(1_000.0, 0.8)))
    assert settle(slow, {}).verdict != "balanced"


def test_nothing_below_the_minimum_gain_is_proposed() -> None:
    diagnosis = diagnose(
        measured(
            loader=points(w0=1_000, w1=1_030, w2=1_040),
            num_workers=1,
            compute_samples_per_s=50_000.0,
            pipeline=pipeline(1_000.0, 0.9),
            fetch=fetch(1e-3),
        )
    )
    assert all(c.predicted_gain > MIN_GAIN for c in diagnosis.changes)
    assert diagnosis.settings == {}


def test_with_batched_fetch_the_advice_quotes_getitems_not_dataset_i() -> None:
    diagnosis = diagnose(
        measured(
            returns_batches=True,
            loader=points(w0=2_000, w1=1_900, w2=3_800, w3=3_900),
            compute_samples_per_s=50_000.0,
            pipeline=pipeline(1_900.0, 0.9),
            fetch=fetch(4e-4, batched_per_sample_s=4.5e-4, collate_per_sample_s=1e-6),
        )
    )
    assert diagnosis.verdict == "input-bound"
    assert "__getitems__ 450.0 µs per sample" in diagnosis.reason
    assert "dataset[i]" not in diagnosis.reason + diagnosis.recommendation
    row = next(r for r in diagnosis.stages if r.stage == "fetch (one process)")
    assert row.samples_per_s == pytest.approx(1 / 4.5e-4)


def test_settle_keeps_only_what_a_short_run_confirmed() -> None:
    diagnosis = diagnose(measured(torch_threads=4, thread_rates={1: 9_000.0}))
    label = diagnosis.changes[0].label()
    assert label == "train.threads=1"
    lost = settle(diagnosis, {label: 1.02})
    assert lost.confirmed and lost.settings == {} and lost.expected_gain is None
    assert "no setting stoker can change measured more than 1.05x" in lost.recommendation
    assert lost.changes[0].confirmed_gain == pytest.approx(1.02)
    won = settle(diagnosis, {label: 1.7})
    assert won.settings == {"train.threads": 1}
    assert won.gain_measured and won.expected_gain == pytest.approx(1.7)
    assert "1.70x (measured in a short run with it applied)" in won.recommendation


def test_settle_recommends_two_changes_together_when_that_ran_fastest() -> None:
    diagnosis = diagnose(
        measured(
            torch_threads=4,
            thread_rates={1: 9_000.0},
            compute_shares=(0.2, 0.2, 0.6),
            fused=False,
            fused_samples_per_s=8_000.0,
        )
    )
    labels = [c.label() for c in diagnosis.changes]
    assert labels == ["train.threads=1", "optim.fused=true"]
    both = "train.threads=1 optim.fused=true"
    settled = settle(diagnosis, {labels[0]: 1.6, labels[1]: 1.4, both: 2.1})
    assert settled.settings == {"train.threads": 1, "optim.fused": True}
    assert settled.expected_gain == pytest.approx(2.1)


def test_startup_correction_never_takes_more_than_the_loaders_own_start_up() -> None:
    # Early windows 0.3 s slower than steady (model warm-up), data wait 0.05 s in a 2 s
    # run: the loader's start-up (0.01 s per epoch) is all that may be taken out.
    kept = startup_wait(excess_s=0.3, loader_startup_s=0.01, epochs=1, wait_s=0.05, run_s=2.0)
    assert kept == pytest.approx(0.01)
    # Unknown loader start-up: at most the data wait measured (the old rule).
    assert startup_wait(excess_s=0.3, loader_startup_s=None, epochs=1, wait_s=0.05, run_s=2.0) == (
        pytest.approx(0.05)
    )


def test_workers_that_start_again_every_epoch_are_proposed_persistent() -> None:
    slow_start = points(w0=500, w2=1_000, w4=2_000)
    slow_start = tuple(dataclasses.replace(p, startup_s=1.0) for p in slow_start)
    common = dict(
        loader=slow_start,
        compute_samples_per_s=50_000.0,
        pipeline=pipeline(480.0, 0.9),
        fetch=fetch(2e-3, cpu_share=0.05),
        dataset_length=4096,
    )

    def workers(epochs: int) -> dict:
        changes = diagnose(measured(epochs=epochs, **common)).changes
        return next(c.settings for c in changes if "loader.num_workers" in c.settings)

    assert workers(5) == {"loader.num_workers": 4, "loader.persistent_workers": True}
    assert workers(1) == {"loader.num_workers": 4}  # one epoch: workers start once anyway


def test_the_best_workers_already_set_but_restarted_every_epoch_are_made_persistent() -> None:
    slow_start = tuple(
        dataclasses.replace(p, startup_s=1.0) for p in points(w0=500, w2=1_000, w4=4_000)
    )
    diagnosis = diagnose(
        measured(
            num_workers=4,
            loader=slow_start,
            compute_samples_per_s=50_000.0,
            pipeline=pipeline(3_900.0, 0.5),
            fetch=fetch(2e-3, cpu_share=0.05),
            dataset_length=4096,
            epochs=5,
        )
    )
    change = next(c for c in diagnosis.changes if "persistent" in c.label())
    assert change.settings == {"loader.persistent_workers": True}
    # 5 epochs of 1.05 s each, plus 1 s of start-up each: 10.25 s; persistent: 6.25 s.
    assert change.predicted_gain == pytest.approx(5 * (1 + 4096 / 3900) / (1 + 5 * 4096 / 3900))
