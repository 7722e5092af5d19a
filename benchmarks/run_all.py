"""Run every CPU benchmark, print one summary table (figure, target, pass/fail), write JSON.

    python benchmarks/run_all.py --out bench-out          # what `make bench` runs

Each benchmark runs in its own process (its log in ``<out>/logs/``) and writes
``<out>/<benchmark>.json``; this script gathers their checks into one table and
``<out>/summary.json``. A benchmark that is missing or fails is shown as ``not run``
with the reason, and the others still run. On a 2-core machine the whole run takes
about 13 minutes (2026-12-02: 779 s, of which the doctor's ten scenarios 315 s and the
tuner's three trials 188 s); ``--quick`` shrinks the memory, tuner, text and Parquet runs.

Exit status: 0 when every target is met, 1 when one is missed, 2 when a benchmark
could not run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Check, info, machine, table, target_check

HERE = Path(__file__).resolve().parent

MIB = 2**20


def memory_checks(report: dict[str, Any]) -> list[Check]:
    """benchmarks/memory.py's JSON as checks: peak RSS per out-of-core run, speed vs memory."""
    bench = "memory"
    target_mb = report["target_peak_rss_mb"]
    target_mib = target_mb * 1e6 / MIB
    runs = report["runs"]
    in_memory = {r["order"]: r for r in runs if r["source"] == "memory"}
    checks = []
    for run in runs:
        if run["source"] == "memory":
            checks.append(
                info(bench, f"{run['name']} throughput", run["samples_per_s"], unit="samples/s")
            )
            continue
        reference = in_memory.get(run["order"], in_memory.get("shuffled"))
        if reference:
            checks.append(
                info(
                    bench,
                    f"{run['name']} throughput / in-memory",
                    run["samples_per_s"] / reference["samples_per_s"],
                    unit="x",
                    note="partial run" if run.get("partial") else "",
                )
            )
        checks.append(
            target_check(
                bench,
                f"{run['name']} peak RSS",
                run["peak_rss_mib"],
                "<",
                round(target_mib),
                unit="MiB",
                note=f"{report['size_gb']} GB on disk",
            )
        )
    return checks


def tuner_checks(report: dict[str, Any]) -> list[Check]:
    """benchmarks/tuner.py's JSON as checks: choice within 10% of the sweep, time <= 25%."""
    bench = "tuner"
    targets = report.get("targets", {})
    summary = report["median"]
    return [
        # The sweep's best is the maximum of noisy one-shot measurements (biased up), so
        # the target is judged on the two measured again, interleaved (tuner.py's figure).
        target_check(
            bench,
            "tuner's choice / sweep's best, remeasured interleaved",
            summary["choice_ratio_remeasured"],
            ">=",
            targets.get("choice_ratio_min", 0.9),
        ),
        info(bench, "the same, from the sweep's one-shot rates", summary["choice_ratio"], unit="x"),
        target_check(
            bench,
            "tuner's time / sweep's time",
            summary["time_ratio"],
            "<=",
            targets.get("time_ratio_max", 0.25),
        ),
    ]


def doctor_checks(report: dict[str, Any]) -> list[Check]:
    """benchmarks/doctor_scenarios.py's JSON as checks: the issue's targets, as shares."""
    bench = "doctor_scenarios"
    s = report["summary"]
    scenarios, with_gain = s["scenarios"], max(s["with_gain"], 1)
    note = f"of {s['with_gain']} scenarios with a gain to find"
    return [
        target_check(bench, "verdicts right", s["verdicts_right"] / scenarios, ">=", 1.0),
        target_check(
            bench,
            "advice reaches 80% of the best gain",
            s["advice_reaches_80pct"] / with_gain,
            ">=",
            0.8,
            note=note,
        ),
        # tune --write writes config: its target is the best config can reach; the share
        # of the sweep's best (code changes included, which the tuner names in a note) is
        # shown beside it.
        target_check(
            bench,
            "tune --write reaches 80% of the best gain by config",
            s["tune_reaches_80pct_of_config_best"] / max(s["with_config_gain"], 1),
            ">=",
            0.8,
            note=f"of {s['with_config_gain']} scenarios with a gain config can reach",
        ),
        info(
            bench,
            "tune --write reaches 80% of the best gain, code changes included",
            s["tune_reaches_80pct"] / with_gain,
            unit="x",
            note=note,
        ),
        target_check(
            bench,
            "tune's prediction within 15% of the realized speed-up",
            s["tune_within_15pct"] / scenarios,
            ">=",
            0.8,
        ),
        target_check(
            bench,
            "tune within its budget (+10%)",
            s["tune_within_budget_10pct"] / scenarios,
            ">=",
            1.0,
        ),
    ]


def own_checks(report: dict[str, Any]) -> list[Check]:
    return [Check(**check) for check in report["checks"]]


#: name: (script, arguments (out, threads) -> argv tail, json file, checks, timeout s, env)
Plan = tuple[str, Callable[[Path, int], list[str]], str, Callable[[dict], list[Check]], int, dict]


def plan(quick: bool) -> dict[str, Plan]:
    def common(out: Path, threads: int) -> list[str]:
        return ["--out", str(out), "--threads", str(threads)]

    # 1 GB: above the 600 MB peak-RSS target, so an out-of-core source that held the
    # whole file would fail it. 3 s per candidate is tuner.py's own default.
    memory_gb = "0.1" if quick else "1"
    tuner_s = "1" if quick else "3"
    # One trial of a search among near-equal settings on a shared 2-core machine can
    # land either side of the 10% line; the median of three is the tuner's typical pick.
    trials = "1" if quick else "3"
    text_samples = "256" if quick else "768"
    parquet_mb = "50" if quick else "200"
    return {
        "loader": ("loader.py", common, "loader.json", own_checks, 180, {}),
        "trainer": ("trainer.py", common, "trainer.json", own_checks, 300, {}),
        "threads": ("threads.py", common, "threads.json", own_checks, 300, {}),
        "workloads": ("workloads.py", common, "workloads.json", own_checks, 600, {}),
        # Byte-level docstrings through a BiGRU: stoker's length buckets vs padding each
        # random batch to its longest text (the hand loop, Lightning).
        "workloads_text": (
            "workloads_text.py",
            lambda out, threads: [*common(out, threads), "--samples", text_samples],
            "workloads_text.json",
            own_checks,
            600,
            {},
        ),
        # Shuffled batches of a Parquet file: stoker vs pyarrow by hand vs HF datasets,
        # each pass in a process of its own (peak RSS per contender).
        "workloads_parquet": (
            "workloads_parquet.py",
            lambda out, threads: [*common(out, threads), "--size-mb", parquet_mb],
            "workloads_parquet.json",
            own_checks,
            600,
            {"OMP_NUM_THREADS": "1"},
        ),
        "instrumentation": (
            "instrumentation.py",
            common,
            "instrumentation.json",
            own_checks,
            120,
            {},
        ),
        "memory": (
            "memory.py",
            lambda out, threads: [
                "--size-gb",
                memory_gb,
                "--max-seconds",
                "10",
                "--json",
                str(out / "memory.json"),
            ],
            "memory.json",
            memory_checks,
            300,
            {"OMP_NUM_THREADS": "1"},
        ),
        # A resume at 90% of an epoch over a ~1 GB file against that epoch's time.
        "resume_cost": (
            "resume_cost.py",
            lambda out, threads: [
                *common(out, threads),
                "--size-gb",
                "0.1" if quick else "1",
            ],
            "resume_cost.json",
            own_checks,
            600,
            {"OMP_NUM_THREADS": "1"},
        ),
        # OMP_NUM_THREADS=1, as tuner.py's docstring runs it (memory.py too: with two
        # OpenMP threads on a busy 2-core machine its in-memory gathers stall for ms).
        "tuner": (
            "tuner.py",
            lambda out, threads: [
                "--final-s",
                tuner_s,
                "--trials",
                trials,
                "--remeasure",
                "3",
                "--out",
                str(out),
            ],
            "tuner.json",
            tuner_checks,
            480,
            {"OMP_NUM_THREADS": "1"},
        ),
        # The scenarios set their own intra-op threads (one; more in the one about that).
        "doctor_scenarios": (
            "doctor_scenarios.py",
            lambda out, threads: ["--out", str(out)],
            "doctor_scenarios.json",
            doctor_checks,
            1200,
            {"OMP_NUM_THREADS": "1"},
        ),
    }


def run_one(name: str, entry: Plan, out: Path, threads: int) -> tuple[list[Check], dict]:
    script, arguments, json_name, to_checks, timeout, env = entry
    path = HERE / script
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    status: dict[str, Any] = {"log": str(log)}
    if not path.exists():
        status["error"] = f"{script} does not exist"
        return [Check(name, "(all)", None, status="not run", note=status["error"])], status
    result_file = out / json_name
    result_file.unlink(missing_ok=True)
    started = time.perf_counter()
    print(f"[{name}] running {script} (log: {log})", flush=True)
    try:
        with log.open("w") as handle:
            process = subprocess.run(
                [sys.executable, str(path), *arguments(out, threads)],
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                check=False,
            )
        code = process.returncode
    except subprocess.TimeoutExpired:
        code = None
    status["seconds"] = round(time.perf_counter() - started, 1)
    if code != 0 or not result_file.exists():
        if code is None:
            reason = f"timed out after {timeout} s"
        elif code == 0:
            reason = f"finished without writing {json_name}"
        else:
            reason = f"exit status {code}"
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        status["error"] = reason + (f": {tail[0][:160]}" if tail else "")
        print(f"[{name}] not run: {status['error']}", flush=True)
        return [Check(name, "(all)", None, status="not run", note=status["error"])], status
    try:
        checks = to_checks(json.loads(result_file.read_text()))
    except (KeyError, TypeError, ValueError) as error:
        status["error"] = f"unreadable {json_name}: {error!r}"
        return [Check(name, "(all)", None, status="not run", note=status["error"])], status
    print(f"[{name}] done in {status['seconds']:.0f} s", flush=True)
    return checks, status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the JSON and logs")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads for the CPU benchmarks"
    )
    parser.add_argument("--only", help="comma-separated benchmarks (default: all)")
    parser.add_argument("--quick", action="store_true", help="smaller memory and tuner runs")
    parser.add_argument(
        "--table",
        action="store_true",
        help="only print the table of an earlier run's <out>/summary.json",
    )
    args = parser.parse_args()
    if args.table:
        saved = json.loads((args.out / "summary.json").read_text())
        print(table([Check(**check) for check in saved["checks"]]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)

    entries = plan(args.quick)
    names = list(entries)
    if args.only:
        names = [n.strip() for n in args.only.split(",")]
        unknown = [n for n in names if n not in entries]
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; choose from {list(entries)}")
    started = time.perf_counter()
    checks: list[Check] = []
    statuses = {}
    for name in names:
        found, statuses[name] = run_one(name, entries[name], args.out, args.threads)
        checks.extend(found)
    total_s = time.perf_counter() - started

    where = machine()
    print()
    print(table(checks))
    dirty = " + local src changes" if where["src_dirty"] else ""
    print(
        f"\n{where['date_utc']} | {where['cpu']} | {where['cores']} cores | torch "
        f"{where['torch']} | {args.threads} intra-op thread(s) | "
        f"load {where['load_average_1m']:.2f} | commit {str(where['commit'])[:10]}{dirty} | "
        f"{total_s:.0f} s"
    )
    failed = [c for c in checks if c.passed is False and not c.status]
    broken = [c for c in checks if c.status == "not run"]
    for check in broken:
        print(f"not run: {check.benchmark}: {check.note}")
    summary = {
        "benchmark": "summary",
        "machine": where,
        "threads": args.threads,
        "seconds": total_s,
        "benchmarks": statuses,
        "checks": [asdict(c) for c in checks],
        "failed": [f"{c.benchmark}: {c.figure}" for c in failed],
        "not_run": [f"{c.benchmark}: {c.note}" for c in broken],
    }
    path = args.out / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print(
        f"{sum(c.passed is True for c in checks)} targets met, {len(failed)} missed, "
        f"{len(broken)} benchmark(s) not run; wrote {path}"
    )
    if broken:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
