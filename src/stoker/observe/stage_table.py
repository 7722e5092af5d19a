"""The doctor's table: one row per stage measured alone, and the caveats on the figures."""

from __future__ import annotations

import math

from stoker.observe.measurements import Measurements, StageFigure
from stoker.observe.stages import LoaderPoint

__all__ = ["stage_figures", "unstable_notes"]

#: Rates within this share of the best count as "as good" (measurement noise).
SAME_RATE = 0.95
#: Repeats that differ by more than this factor make a figure unstable (a busy machine).
UNSTABLE_SPREAD = 2.0


def _fewest_workers(points: list[LoaderPoint]) -> LoaderPoint | None:
    """The fewest workers whose rate is within noise of the best of ``points``."""
    if not points:
        return None
    best = max(p.samples_per_s for p in points)
    good = [p for p in points if p.samples_per_s >= SAME_RATE * best]
    return min(good, key=lambda p: p.num_workers)


def _loader_figures(m: Measurements, pipeline: float) -> list[StageFigure]:
    best = _fewest_workers(list(m.loader))
    rows = []
    for point in m.loader:
        notes = []
        if point.num_workers == m.num_workers:
            notes.append("configured")
        if best is not None and point.num_workers == best.num_workers:
            notes.append("best")
        notes.append(f"start-up {point.startup_s:.2f} s")
        rows.append(
            StageFigure(
                stage=f"loader ({point.num_workers} worker{'s' * (point.num_workers != 1)})",
                samples_per_s=point.samples_per_s,
                vs_pipeline=_ratio(point.samples_per_s, pipeline),
                note=", ".join(notes),
            )
        )
    return rows


def _ratio(rate: float | None, pipeline: float) -> float | None:
    if rate is None or pipeline <= 0:
        return None
    return rate / pipeline


def stage_figures(m: Measurements) -> tuple[StageFigure, ...]:
    """One row per pipeline stage, with its measured rate and a note on how it was measured."""
    pipeline = m.pipeline.steady_samples_per_s
    rows = _loader_figures(m, pipeline)
    if m.transfer is None:
        rows.append(StageFigure("transfer", None, None, "no accelerator: transfer is a no-op"))
    else:
        t = m.transfer
        rows.append(
            StageFigure(
                "transfer (pageable)",
                t.pageable_samples_per_s,
                _ratio(t.pageable_samples_per_s, pipeline),
                f"{t.pageable_gb_per_s:.1f} GB/s, {t.batch_bytes / 1e6:.2f} MB per batch",
            )
        )
        if t.pinned_gb_per_s is not None:
            rows.append(
                StageFigure(
                    "transfer (pinned)",
                    t.pinned_samples_per_s,
                    _ratio(t.pinned_samples_per_s, pipeline),
                    f"{t.pinned_gb_per_s:.1f} GB/s",
                )
            )
    rows.append(
        StageFigure(
            "compute",
            m.compute_samples_per_s,
            _ratio(m.compute_samples_per_s, pipeline),
            _compute_note(m),
        )
    )
    for count, rate in sorted(m.thread_rates.items()):
        rows.append(
            StageFigure(
                f"compute ({count} thread{'s' * (count != 1)})",
                rate,
                _ratio(rate, pipeline),
                "intra-op threads (torch.set_num_threads)",
            )
        )
    if m.fused_samples_per_s is not None:
        rows.append(
            StageFigure(
                "compute (optim.fused=true)",
                m.fused_samples_per_s,
                _ratio(m.fused_samples_per_s, pipeline),
                f"PyTorch's fused {m.optimizer}",
            )
        )
    if m.fetch is not None:
        f = m.fetch
        notes = [f"dataset[i] {f.per_sample_s * 1e6:.1f} µs ({f.cpu_share:.0%} CPU)"]
        if f.collate_per_sample_s is not None:
            notes.append(f"collate {f.collate_per_sample_s * 1e6:.2f} µs/sample")
        if f.batched_per_sample_s is not None:
            notes.append(f"__getitems__ {f.batched_per_sample_s * 1e6:.2f} µs/sample")
        per_sample = f.per_sample_s
        if m.returns_batches and f.batched_per_sample_s is not None:
            per_sample = f.batched_per_sample_s  # what the loader pays, not dataset[i]
        rate = 1 / per_sample if per_sample > 0 else math.inf
        rows.append(
            StageFigure("fetch (one process)", rate, _ratio(rate, pipeline), ", ".join(notes))
        )
    p = m.pipeline
    rows.append(
        StageFigure(
            "pipeline",
            pipeline,
            1.0 if pipeline > 0 else None,
            f"{p.steps} steps, data wait {p.steady_data_wait_fraction:.0%} "
            f"({p.data_wait_fraction:.0%} with start-up){_phase_note(p.phases)}",
        )
    )
    return tuple(rows)


def _compute_note(m: Measurements) -> str:
    note = f"forward+backward+step on {m.device}, {m.torch_threads} thread(s)"
    if m.compute_shares is not None:
        forward, backward, optimizer = m.compute_shares
        note += (
            f"; forward {forward:.0%}, backward {backward:.0%}, optimizer {optimizer:.0%}"
            f" ({m.optimizer}, {'fused' if m.fused else 'not fused'})"
        )
    return note


def _phase_note(phases: dict[str, float]) -> str:
    shown = [(k, v) for k, v in phases.items() if v >= 0.005 and k != "data_wait"]
    if not shown:
        return ""
    return "; " + ", ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in shown)


def unstable_notes(m: Measurements) -> list[str]:
    """Why the rates may vary between runs (a busy machine, ...), printed under the table."""
    notes = []
    if m.machine_load is not None and m.machine_load >= 0.5 * m.cores:
        notes.append(
            f"the machine was busy before measuring (load {m.machine_load:.1f} on {m.cores} "
            "cores): other processes share the CPUs, so rates vary"
        )
    spreads = {f"loader ({p.num_workers} workers)": p.repeats for p in m.loader}
    spreads["compute"] = m.compute_repeats
    for name, repeats in spreads.items():
        finite = [r for r in repeats if math.isfinite(r) and r > 0]
        if len(finite) >= 2 and max(finite) / min(finite) > UNSTABLE_SPREAD:
            notes.append(
                f"{name}: repeats varied {max(finite) / min(finite):.1f}x "
                "(a busy machine?); rerun with more --seconds to confirm"
            )
    return notes
