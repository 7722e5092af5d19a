"""The changes of settings the doctor proposes, each with the pipeline speed-up the stage
ceilings predict for it (pure functions of the measurements; no timing here)."""

from __future__ import annotations

from typing import Any

from stoker.observe.measurements import Change, Measurements
from stoker.observe.stages import LoaderPoint

__all__ = [
    "CHEAP_SAMPLE_S",
    "MIN_GAIN",
    "SAME_RATE",
    "cache_change",
    "fused_change",
    "now_rate",
    "serial_rate",
    "threads_change",
    "worker_change",
]

#: A ``dataset[i]`` cheaper than this is Python and dispatch overhead, not real work.
CHEAP_SAMPLE_S = 50e-6
#: Rates within this share of the best count as "as good" (measurement noise).
SAME_RATE = 0.95
#: A change is advised only when it wins more than this (predicted, then measured).
MIN_GAIN = 1.05


# --- predicted pipeline rates ------------------------------------------------------------


def serial_rate(loader: float, compute: float) -> float:
    """Loading in the training process: each batch is loaded, then computed."""
    if loader <= 0 or compute <= 0:
        return 0.0
    return 1 / (1 / loader + 1 / compute)


def _rate_with(
    m: Measurements, *, workers: int | None = None, compute: float | None = None
) -> float:
    """The pipeline's rate the stage ceilings predict: workers overlap loading with
    compute (the slower sets the pace); without workers the two add up."""
    workers = m.num_workers if workers is None else workers
    compute = m.compute_samples_per_s if compute is None else compute
    loader = m.loader_rate(workers)
    if workers == 0:
        return serial_rate(loader, compute)
    return min(loader, compute)


def now_rate(m: Measurements) -> float:
    """The configured pipeline's rate: the ceilings' prediction, or the measured rate
    when lower (the workers then take CPU from the training process, which the
    ceilings, each measured alone, do not see)."""
    predicted = _rate_with(m)
    measured = m.pipeline.steady_samples_per_s
    return min(predicted, measured) if measured > 0 else predicted


def worker_change(m: Measurements, points: list[LoaderPoint]) -> Change | None:
    """The worker count with the best predicted pipeline (the fewest within noise)."""
    now = now_rate(m)
    if now <= 0 or not points:
        return None
    predicted = {p.num_workers: _rate_with(m, workers=p.num_workers) for p in points}
    best = max(predicted.values())
    count = min(w for w, rate in predicted.items() if rate >= SAME_RATE * best)
    gain = predicted[count] / now
    if count == m.num_workers:
        return _persistent_change(m, points)
    if gain <= MIN_GAIN:
        return None
    loader = m.loader_rate(count)
    how = "loading in the training process, between steps" if count == 0 else "alone"
    settings: dict[str, Any] = {"loader.num_workers": count}
    if count == 0 and m.persistent_workers:
        settings["loader.persistent_workers"] = False  # no workers to keep alive
    startup = next((p.startup_s for p in points if p.num_workers == count), 0.0)
    if count and m.epochs > 1 and m.dataset_length and not m.persistent_workers:
        epoch_s = m.dataset_length / predicted[count]
        if startup >= 0.05 * epoch_s:
            # Workers start again every epoch unless they persist: a cost per epoch.
            settings["loader.persistent_workers"] = True
    return Change(
        settings=settings,
        why=(
            f"the loader {how} delivers {loader:,.0f} samples/s with {count} workers vs "
            f"{m.configured_loader_rate:,.0f} with {m.num_workers}; compute alone "
            f"{m.compute_samples_per_s:,.0f}"
        ),
        predicted_gain=gain,
    )


def _persistent_change(m: Measurements, points: list[LoaderPoint]) -> Change | None:
    """``persistent_workers=true`` when the configured workers start again every epoch
    and that start-up is a share of the run worth winning back."""
    if not m.num_workers or m.persistent_workers or m.epochs < 2 or not m.dataset_length:
        return None
    startup = next((p.startup_s for p in points if p.num_workers == m.num_workers), 0.0)
    epoch_s = m.dataset_length / max(now_rate(m), 1e-12)
    run_now = m.epochs * (startup + epoch_s)
    gain = run_now / (startup + m.epochs * epoch_s)
    if gain <= MIN_GAIN:
        return None
    return Change(
        settings={"loader.persistent_workers": True},
        why=(
            f"the {m.num_workers} workers take {startup:.2f} s to start, again in each of "
            f"the run's {m.epochs} epochs of about {epoch_s:.1f} s"
        ),
        predicted_gain=gain,
    )


def fused_change(m: Measurements) -> Change | None:
    """The fused optimizer, when it was measured to gain enough; else None."""
    if m.fused or m.fused_samples_per_s is None or m.optimizer not in ("adam", "adamw"):
        return None
    gain = _rate_with(m, compute=m.fused_samples_per_s) / max(now_rate(m), 1e-12)
    if gain <= MIN_GAIN:
        return None
    return Change(
        settings={"optim.fused": True},
        why=(
            f"the optimizer step takes {m.optimizer_share:.0%} of a compute step; with "
            f"PyTorch's fused {m.optimizer} compute alone runs "
            f"{m.fused_samples_per_s:,.0f} samples/s vs {m.compute_samples_per_s:,.0f}"
        ),
        predicted_gain=gain,
    )


def threads_change(m: Measurements) -> Change | None:
    """The thread count measured fastest, when it gains enough over the current one; else None."""
    if not m.thread_rates:
        return None
    count, rate = max(m.thread_rates.items(), key=lambda item: item[1])
    if count == m.torch_threads or rate <= m.compute_samples_per_s:
        # Not faster alone: any gain the ceilings predicted would be the pipeline's own
        # shortfall against them, which no thread count wins back (2 threads at 222k
        # against 246k at 1 were proposed beside a cache, at a predicted 1.17x).
        return None
    gain = _rate_with(m, compute=rate) / max(now_rate(m), 1e-12)
    if gain <= MIN_GAIN:
        return None
    return Change(
        settings={"train.threads": count},
        why=(
            f"compute alone runs {rate:,.0f} samples/s at {count} intra-op thread(s) vs "
            f"{m.compute_samples_per_s:,.0f} at {m.torch_threads} on {m.cores} cores: "
            + (
                "the threads wait for each other and for the loader's processes"
                if count < m.torch_threads
                else "cores the loader leaves free sit unused"
            )
        ),
        predicted_gain=gain,
    )


def cache_change(m: Measurements) -> Change | None:
    """``data.cache=memory`` when the run has epochs enough to pay back filling the cache
    (filled once, one sample at a time): the later epochs skip ``dataset[i]`` and fetch
    whole batches with one gather. A cheap ``dataset[i]`` is proposed too: fetching and
    collating it one sample at a time is what the gather saves (the loader-overhead
    verdict), and the doctor's short run measures what it wins."""
    f, n = m.fetch, m.dataset_length
    if f is None or not n or m.cache != "none" or m.epochs < 2:
        return None
    now = now_rate(m)
    cached_loader = 1 / max(f.collate_per_sample_s or 0.0, 1e-7)
    cached = (
        min(cached_loader, m.compute_samples_per_s)
        if m.num_workers
        else serial_rate(cached_loader, m.compute_samples_per_s)
    )
    fill_sample_s = f.fill_per_sample_s or f.per_sample_s  # read in order, as the fill does
    fill_s = n * fill_sample_s
    run_now = m.epochs * n / now
    run_cached = fill_s + m.epochs * n / cached
    gain = run_now / run_cached
    if gain <= MIN_GAIN:
        return None
    epoch_now = n / now
    return Change(
        settings={"data.cache": "memory"},
        why=(
            f"dataset[i] takes {f.per_sample_s * 1e3:.2f} ms; cached, the later epochs "
            f"skip it: the ceilings predict {m.epochs} epochs in {run_cached:.1f} s instead "
            f"of {run_now:.1f} s"
        ),
        predicted_gain=gain,
        cost=(
            f"filling the cache costs about {fill_s:.1f} s once ({n:,} samples at "
            f"{fill_sample_s * 1e3:.2f} ms, in order, in the training process): the "
            f"first epoch takes about {fill_s + n / cached:.1f} s, later ones about "
            f"{n / cached:.1f} s, against {epoch_now:.1f} s each now; the gain is over the "
            f"run's {m.epochs} epochs, and the decoded samples must fit in memory"
        ),
    )
