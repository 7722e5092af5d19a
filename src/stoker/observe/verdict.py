"""The end-of-run verdict: what the phase times say bounds the run, and what to do about it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from stoker.observe.timing import PhaseStats, reported_phases

INPUT_BOUND_PCT = 20.0
PARTLY_INPUT_BOUND_PCT = 5.0
COMMUNICATION_BOUND_PCT = 20.0
TRANSFER_BOUND_PCT = 15.0


@dataclass(frozen=True)
class Verdict:
    """A name from a closed set, the figures behind it, and the fix."""

    verdict: str
    data_stall_pct: float
    transfer_pct: float
    recommendation: str

    def to_dict(self) -> dict[str, Any]:
        """Plain data, for JSON."""
        return asdict(self)


def judge(stats: dict[str, PhaseStats], *, num_workers: int, device_type: str) -> Verdict:
    """Classify a run by its phase shares.

    input-bound: the training thread waits for data ≥ 20% of the step; partly
    input-bound: 5–20%; transfer-bound: host→device copies take ≥ 15% and more than
    the data wait; communication-bound: a rank waits ≥ 20% of the step for the others
    (distributed), more than for data or copies; compute-bound otherwise. The data wait
    excludes the time a rank spent in the loader's collective waiting for the others
    (``communication``): a rank that waits for a slower one is not short of data.
    """
    stall = 100.0 * stats["data_wait"].share
    transfer = 100.0 * stats["transfer"].share
    waiting = 100.0 * stats["communication"].share if "communication" in stats else 0.0
    if waiting >= COMMUNICATION_BOUND_PCT and waiting > max(stall, transfer):
        return Verdict(
            "communication-bound",
            stall,
            transfer,
            f"this rank waits for the other ranks {waiting:.0f}% of each step: look for a "
            "slower rank (its own data stall, a busier device or machine), give every rank "
            "the same work per batch, and raise loader.batch_size or train.grad_accum_steps "
            "so the ranks meet less often",
        )
    if transfer >= TRANSFER_BOUND_PCT and transfer > stall:
        return Verdict(
            "transfer-bound",
            stall,
            transfer,
            f"host-to-device copies take {transfer:.0f}% of each step: set loader.pin_memory=true "
            "so copies are non-blocking and overlap compute, keep batches compact (uint8/fp16 "
            "inputs, normalize on the device), and move fewer fields to the device",
        )
    if stall >= INPUT_BOUND_PCT:
        more = (
            f"raise loader.num_workers above {num_workers}"
            if num_workers < 8
            else "cache decoded samples (stoker.data.CachedDataset)"
        )
        return Verdict(
            "input-bound",
            stall,
            transfer,
            f"the model waits for data {stall:.0f}% of the time: {more}, use batched fetch "
            "(__getitems__ / ArrayDataset), and run `stoker tune CONFIG` to measure the best "
            "loader settings",
        )
    if stall >= PARTLY_INPUT_BOUND_PCT:
        return Verdict(
            "partly input-bound",
            stall,
            transfer,
            f"the model waits for data {stall:.0f}% of the time: `stoker tune CONFIG` finds "
            "loader settings that hide it (workers, prefetch_factor, persistent_workers)",
        )
    if device_type == "cpu":
        advice = (
            "the loader keeps up; on this CPU the model's own compute is the limit: a larger "
            "batch, train.compile=true, or an accelerator"
        )
    else:
        advice = (
            "the loader keeps up; speed up the model itself: train.precision=bf16, "
            "train.compile=true, a larger batch"
        )
    return Verdict("compute-bound", stall, transfer, advice)


def phase_table_rows(stats: dict[str, PhaseStats]) -> list[tuple[str, float, float, float]]:
    """(phase, median ms, p95 ms, share %) per phase (``communication`` when some
    rank waited in the loader's collective) and for the whole step."""
    rows = [
        (phase, stats[phase].median_s * 1e3, stats[phase].p95_s * 1e3, 100 * stats[phase].share)
        for phase in reported_phases(stats)
    ]
    step = stats["step"]
    rows.append(("step", step.median_s * 1e3, step.p95_s * 1e3, 100.0))
    return rows


def run_summary(
    stats: dict[str, PhaseStats], *, num_workers: int, device_type: str, samples_per_s: float
) -> dict[str, Any]:
    """What ``summary.json`` holds: the verdict, the fix, and per-phase medians and shares."""
    if not stats:
        return {"verdict": "no steps", "recommendation": "the run took no optimizer step"}
    verdict = judge(stats, num_workers=num_workers, device_type=device_type)
    return {
        **verdict.to_dict(),
        "samples_per_s": samples_per_s,
        "phases": {
            phase: {"median_ms": median, "p95_ms": p95, "share_pct": share}
            for phase, median, p95, share in phase_table_rows(stats)
        },
    }


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The end-of-run table as plain text lines (the same under rich and in logs)."""
    if "phases" not in summary:
        return [f"verdict: {summary['verdict']}"]
    width = max(10, *map(len, summary["phases"]))  # "communication" is longer
    lines = [f"{'phase':<{width}} {'median ms':>10} {'p95 ms':>10} {'share':>7}"]
    for phase, row in summary["phases"].items():
        lines.append(
            f"{phase:<{width}} {row['median_ms']:>10.3f} {row['p95_ms']:>10.3f} "
            f"{row['share_pct']:>6.1f}%"
        )
    lines.append(
        f"data stall {summary['data_stall_pct']:.1f}%  ·  "
        f"{summary['samples_per_s']:,.0f} samples/s  ·  verdict: {summary['verdict']}"
    )
    lines.append(f"advice: {summary['recommendation']}")
    return lines
