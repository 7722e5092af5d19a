"""The doctor's verdict and advice, drawn from the measured stage figures alone (no timing
here): which stage sets the pace, which settings could win, and by how much."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

from stoker.observe.measurements import Change, Diagnosis, Measurements, Verdict
from stoker.observe.proposals import (
    CHEAP_SAMPLE_S,
    MIN_GAIN,
    cache_change,
    fused_change,
    threads_change,
    worker_change,
)
from stoker.observe.stage_table import stage_figures, unstable_notes
from stoker.observe.stages import LoaderPoint

__all__ = [
    "CHEAP_SAMPLE_S",
    "COLLATE_BOUND_SHARE",
    "INPUT_BOUND_WAIT",
    "MIN_GAIN",
    "OPTIMIZER_BOUND_SHARE",
    "PARTLY_INPUT_BOUND_WAIT",
    "diagnose",
    "settle",
]

#: Data wait at or above this share of step time: the loader sets the pace.
INPUT_BOUND_WAIT = 0.20
#: Data wait at or above this share (and below INPUT_BOUND_WAIT): partly input-bound.
PARTLY_INPUT_BOUND_WAIT = 0.05
#: A transfer ceiling below this share of the loader and compute ceilings binds.
TRANSFER_MARGIN = 0.8
#: Collate at or above this share of the loader's in-process work per sample binds.
COLLATE_BOUND_SHARE = 0.5
#: A collate cheaper than this per sample is dispatch overhead, not a cost of its own.
CHEAP_COLLATE_S = 20e-6
#: The optimizer at or above this share of a compute step binds.
OPTIMIZER_BOUND_SHARE = 0.35
#: Compute this much faster at fewer threads: the threads oversubscribe the cores.
THREADS_GAIN = 1.3
#: The configured loader's ceiling within this factor of compute: both stages bind.
BALANCED_RATIO = 2.0
#: A loader alone this much under compute still keeps up, once no setting ran faster:
#: the two are timed apart, and their rates move by this much between measurements.
KEEPS_UP_MARGIN = 1.1


# --- the verdict -------------------------------------------------------------------------


def _oversubscribed(m: Measurements) -> list[LoaderPoint] | None:
    """The worker counts to choose from instead, when more workers are configured than
    the cores serve; None when they are not.

    Two pieces of evidence, either enough: the measured rate grows far less than the
    worker count beyond the cores (the workers share the same CPUs), or the per-sample
    work is CPU time and the workers together want more CPU than there is.
    """
    configured = m.num_workers
    if configured <= m.cores:
        return None
    within = [p for p in m.loader if p.num_workers <= m.cores]
    fewer = [p for p in m.loader if p.num_workers < configured and p.num_workers <= m.cores + 1]
    if not within or not fewer:
        return None
    if m.fetch is not None and m.fetch.cpu_share < 0.5:
        return None  # workers that mostly wait may outnumber the cores
    base = max(within, key=lambda p: p.samples_per_s)
    scaling = m.configured_loader_rate / base.samples_per_s if base.samples_per_s > 0 else 0.0
    linear = configured / max(base.num_workers, 1)
    poor_scaling = scaling < 0.5 * linear
    cpu_demand = configured * m.fetch.cpu_share if m.fetch is not None else 0.0
    if not (poor_scaling or cpu_demand > m.cores):
        return None
    return fewer


def _collate_share(m: Measurements) -> float:
    """Collate's share of the loader's own work per sample (fetch + collate, both timed
    in one process, side by side: their ratio holds however busy the machine is); 0 for a
    collate cheaper than CHEAP_COLLATE_S, which cannot bind whatever its share."""
    f = m.fetch
    if f is None or f.collate_per_sample_s is None or f.collate_per_sample_s < CHEAP_COLLATE_S:
        return 0.0
    fetch_s = f.batched_per_sample_s if m.returns_batches and f.batched_per_sample_s else None
    fetch_s = f.per_sample_s if fetch_s is None else fetch_s
    return f.collate_per_sample_s / (fetch_s + f.collate_per_sample_s)


def _fetch_words(m: Measurements) -> str:
    """The per-sample fetch cost as the loader pays it (batched or one by one)."""
    f = m.fetch
    if f is None:
        return "the stream's samples"
    if m.returns_batches and f.batched_per_sample_s is not None:
        return f"__getitems__ {f.batched_per_sample_s * 1e6:.1f} µs per sample"
    return f"dataset[i] {f.per_sample_s * 1e6:.1f} µs ({f.cpu_share:.0%} CPU)"


def _verdict(m: Measurements) -> tuple[Verdict, str, list[str]]:
    """The verdict, the reason in words, and code advice (what no setting does)."""
    pipeline = m.pipeline.steady_samples_per_s
    wait = m.pipeline.steady_data_wait_fraction
    loader_now = m.configured_loader_rate
    compute = m.compute_samples_per_s
    figures = (
        f"the loader alone delivers {loader_now:,.0f} samples/s with {m.num_workers} workers, "
        f"compute alone {compute:,.0f}, the pipeline {pipeline:,.0f}"
    )
    share = f"the pipeline waits for data {wait:.0%} of the time"
    # Oversubscribed: faster at fewer threads (more threads faster is a change, not a fault).
    fewer = {count: rate for count, rate in m.thread_rates.items() if count < m.torch_threads}
    best_threads = max(fewer.values(), default=0.0)
    if wait < INPUT_BOUND_WAIT and best_threads >= THREADS_GAIN * compute:
        count = max(fewer, key=fewer.__getitem__)
        return (
            "threads-oversubscribed",
            f"compute alone runs {best_threads / compute:.1f}x faster at {count} intra-op "
            f"thread(s) than at {m.torch_threads} on {m.cores} cores shared with "
            f"{m.num_workers} loader worker(s): threads spin waiting for a core; {share}",
            [],
        )
    f = m.fetch
    if wait < INPUT_BOUND_WAIT and compute <= loader_now < BALANCED_RATIO * compute:
        return (
            "balanced",
            f"{share}; the loader ({loader_now:,.0f} samples/s with {m.num_workers} workers) "
            f"keeps up with compute ({compute:,.0f}) with less than {BALANCED_RATIO:g}x to "
            f"spare, and the two overlap; the pipeline runs {pipeline:,.0f}",
            [],
        )
    if wait >= PARTLY_INPUT_BOUND_WAIT:
        if _oversubscribed(m) is not None:
            demand = ""
            if f is not None:
                demand = (
                    f"; dataset[i] is {f.cpu_share:.0%} CPU work, so {m.num_workers} workers "
                    f"want {m.num_workers * f.cpu_share:.1f} of {m.cores} cores"
                )
            return "oversubscribed", f"{share}{demand}; {figures}", []
        collate = _collate_share(m)
        if f is not None and collate >= COLLATE_BOUND_SHARE:
            assert f.collate_per_sample_s is not None
            ceiling = min(compute, 1 / max(f.per_sample_s, 1e-9)) / max(pipeline, 1e-9)
            return (
                "collate-bound",
                f"{share}; collate_fn takes {f.collate_per_sample_s * 1e6:.1f} µs per sample, "
                f"{collate:.0%} of the loader's work ({_fetch_words(m)}); {figures}",
                [
                    "vectorise the collate_fn (stack whole tensors, no per-sample Python loop): "
                    f"it can win up to {ceiling:.1f}x",
                ],
            )
        if not m.returns_batches and f is not None and f.per_sample_s < CHEAP_SAMPLE_S:
            return (
                "loader-overhead",
                f"{share}; each sample is cheap ({_fetch_words(m)}) but the loader spends "
                f"{1e6 / max(loader_now, 1e-9):.1f} µs per sample fetching and collating "
                f"one at a time, while compute needs {1e6 / compute:.1f} µs",
                [
                    "fetch whole batches: give the dataset a __getitems__(indices) that "
                    "returns one batch, or keep the data in a stoker ArrayDataset (in-memory "
                    "tensors); with no code change, data.cache=memory reads a deterministic "
                    "dataset once into arrays and serves it a batch at a time; "
                    f"it can win up to {compute / max(pipeline, 1e-9):.1f}x (the compute ceiling)"
                ],
            )
        code = []
        if f is None:
            code.append("yield whole batches from the stream instead of single samples")
        elif not m.returns_batches:
            code.append(
                "fetch whole batches (data.cache=memory, __getitems__ or a stoker ArrayDataset)"
            )
        verdict: Verdict = "input-bound" if wait >= INPUT_BOUND_WAIT else "partly input-bound"
        return verdict, f"{share}; {_fetch_words(m)}; {figures}", code
    if m.optimizer_share >= OPTIMIZER_BOUND_SHARE:
        code = []
        if m.optimizer == "sgd" or m.fused:
            code.append(
                "fewer, larger parameter tensors (the step's cost is per tensor), or an "
                "optimizer with foreach=True / fused=True built in your own code"
            )
        return (
            "optimizer-bound",
            f"the optimizer step takes {m.optimizer_share:.0%} of compute "
            f"({'fused' if m.fused else 'not fused: one small update per parameter tensor'}); "
            f"{share}; {figures}",
            code,
        )
    code = ["bf16 autocast (train.precision=bf16) or torch.compile (train.compile=true)"]
    if m.device == "cpu":
        code.insert(0, "train on a GPU")
    return "compute-bound", f"{share}; {figures}", code


_BOTTLENECK = {
    "input-bound": "loader",
    "partly input-bound": "loader",
    "loader-overhead": "loader",
    "collate-bound": "loader",
    "oversubscribed": "loader",
    "transfer-bound": "transfer",
    "threads-oversubscribed": "compute",
    "optimizer-bound": "compute",
    "balanced": "compute",
    "compute-bound": "compute",
}


def _proposals(m: Measurements, verdict: Verdict) -> list[Change]:
    """Every change of settings the ceilings predict wins more than MIN_GAIN, best first."""
    points = list(m.loader)
    if verdict == "oversubscribed":
        points = _oversubscribed(m) or points
    found = [
        worker_change(m, points),
        fused_change(m),
        threads_change(m),
        cache_change(m),
    ]
    changes = [c for c in found if c is not None]
    return sorted(changes, key=lambda c: -c.predicted_gain)


def _transfer(m: Measurements, make: Any) -> Diagnosis | None:
    transfer = m.transfer
    if transfer is None:
        return None
    loader_now, compute = m.configured_loader_rate, m.compute_samples_per_s
    pipeline = m.pipeline.steady_samples_per_s
    now = transfer.pageable_samples_per_s
    if m.pin_memory and transfer.pinned_samples_per_s is not None:
        now = transfer.pinned_samples_per_s
    if now >= TRANSFER_MARGIN * min(loader_now, compute):
        return None
    pinned = transfer.pinned_samples_per_s
    reason = (
        f"host-to-device copies carry {now:,.0f} samples/s "
        f"({transfer.batch_bytes / 1e6:.1f} MB per batch), below the loader "
        f"({loader_now:,.0f}) and compute ({compute:,.0f})"
    )
    code = ["copy less: send compact dtypes (uint8 images, int32 ids) and convert on the device"]
    changes: list[Change] = []
    if not m.pin_memory and pinned is not None and pipeline > 0:
        gain = min(pinned, loader_now, compute) / pipeline
        if gain > MIN_GAIN:
            changes.append(
                Change(
                    {"loader.pin_memory": True},
                    f"pinned copies carry {pinned:,.0f} samples/s (non_blocking, they "
                    "overlap compute)",
                    gain,
                )
            )
    return make("transfer-bound", reason, changes, code)


def diagnose(m: Measurements) -> Diagnosis:
    """Name the bottleneck from the measured figures and propose what to change.

    The verdict, in order: ``transfer-bound`` (copies slower than loader and compute,
    with an accelerator); ``threads-oversubscribed`` (compute measured >= 1.3x faster at
    fewer intra-op threads); ``balanced`` (data wait < 20%, the configured loader faster
    than compute by less than 2x); when the pipeline waits for data >= 5% of the time:
    ``oversubscribed`` (more workers than cores serve), ``collate-bound`` (collate,
    >= 20 µs per sample, is half or more of the loader's work), ``loader-overhead``
    (cheap samples fetched one by one), else ``input-bound`` (>= 20%) or
    ``partly input-bound``; otherwise ``optimizer-bound`` (the step >= 35% of compute) or
    ``compute-bound``.

    The proposed changes come from every stage measured, whatever the verdict: the
    worker count with the best predicted pipeline (0 included, beyond the cores when
    the fetch waits), the fused optimizer, the intra-op thread count, a memory cache.
    Each predicted to win more than 1.05x is kept; :func:`settle` keeps those a short
    run of the pipeline with the change applied confirms.
    """
    stages = stage_figures(m)
    notes = tuple(unstable_notes(m))

    def make(verdict: Verdict, reason: str, changes: list[Change], code: list[str]) -> Diagnosis:
        best = changes[0] if changes else None
        return Diagnosis(
            verdict=verdict,
            bottleneck=_BOTTLENECK[verdict],  # type: ignore[arg-type]
            reason=reason,
            recommendation=_words(changes, code, confirmed=False),
            recommended_loader=_loader_keys(best.settings if best else {}),
            expected_gain=best.predicted_gain if best else None,
            gain_measured=False,
            stages=stages,
            measurements=m,
            warnings=notes,
            settings=dict(best.settings) if best else {},
            changes=tuple(changes),
            code_advice=tuple(code),
        )

    transfer = _transfer(m, make)
    if transfer is not None:
        return transfer
    verdict, reason, code = _verdict(m)
    return make(verdict, reason, _proposals(m, verdict), code)


def _loader_keys(settings: dict[str, Any]) -> dict[str, Any]:
    return {k.split(".", 1)[1]: v for k, v in settings.items() if k.startswith("loader.")}


def _words(changes: list[Change], code: list[str], *, confirmed: bool) -> str:
    parts = []
    if changes:
        best = changes[0]
        gain = best.confirmed_gain if confirmed else best.predicted_gain
        how = "measured in a short run with it applied" if confirmed else "predicted"
        parts.append(f"set {best.label()}: {gain:.2f}x ({how}); {best.why}")
        if best.cost:
            parts.append(best.cost)
    else:
        parts.append(
            "no setting stoker can change measured more than "
            f"{MIN_GAIN:.2f}x faster in a short run of the pipeline"
            if confirmed
            else f"no setting stoker can change is predicted to win more than {MIN_GAIN:.2f}x"
        )
    parts.extend(f"in code: {advice}" for advice in code)
    return "; ".join(parts)


def settle(diagnosis: Diagnosis, confirmed: dict[str, float]) -> Diagnosis:
    """Keep the proposals a short run confirmed: ``confirmed`` maps each tried change's
    label to its measured pipeline speed-up; the best above MIN_GAIN is recommended."""
    tried = [
        dataclasses.replace(c, confirmed_gain=confirmed[c.label()])
        for c in diagnosis.changes
        if c.label() in confirmed
    ]
    extra = [
        _combined(diagnosis.changes, label, gain)
        for label, gain in confirmed.items()
        if label not in {c.label() for c in diagnosis.changes}
    ]
    tried += [c for c in extra if c is not None]
    winners = sorted(
        (c for c in tried if (c.confirmed_gain or 0) > MIN_GAIN),
        key=lambda c: -c.confirmed_gain,  # type: ignore[operator]
    )
    best = winners[0] if winners else None
    verdict, bottleneck, reason = diagnosis.verdict, diagnosis.bottleneck, diagnosis.reason
    m = diagnosis.measurements
    loader, compute = m.configured_loader_rate, m.compute_samples_per_s
    if (
        best is None
        and verdict in ("input-bound", "partly input-bound")
        and compute / KEEPS_UP_MARGIN <= loader < BALANCED_RATIO * compute
    ):
        # The loader alone keeps up (or all but: two stages timed apart differ by that
        # much), and no loader setting ran faster: the wait is the two stages sharing the
        # cores and each batch's jitter, not a loader too slow (a wait of 21% here was
        # called input-bound, with no setting to offer; a loader 5% under compute with
        # an 11% wait, partly input-bound).
        verdict, bottleneck = "balanced", _BOTTLENECK["balanced"]
        keeps_up = "keeps up with" if loader >= compute else "all but keeps up with"
        reason = (
            f"{reason}; the loader alone {keeps_up} compute ({loader:,.0f} vs "
            f"{compute:,.0f} samples/s) and no setting ran faster: the wait is the two "
            "sharing the machine"
        )
    return dataclasses.replace(
        diagnosis,
        verdict=verdict,
        bottleneck=bottleneck,
        reason=reason,
        recommendation=_words(winners, list(diagnosis.code_advice), confirmed=True),
        recommended_loader=_loader_keys(best.settings if best else {}),
        settings=dict(best.settings) if best else {},
        expected_gain=best.confirmed_gain if best else None,
        gain_measured=best is not None,
        changes=tuple(tried),
        confirmed=True,
    )


def _combined(changes: tuple[Change, ...], label: str, gain: float) -> Change | None:
    """A change made of several proposals together (its label joins theirs)."""
    parts = [c for c in changes if c.label() in label]
    if len(parts) < 2:
        return None
    settings = functools.reduce(lambda a, c: {**a, **c.settings}, parts, {})
    return Change(
        settings=settings,
        why="; ".join(c.why for c in parts),
        predicted_gain=math.prod(c.predicted_gain for c in parts),
        confirmed_gain=gain,
        cost="; ".join(c.cost for c in parts if c.cost),
    )
