"""Out-of-core Parquet, side by side: stoker's Parquet source, hand-written pyarrow, HF datasets.

One Parquet file of about ``--size-mb`` (64 float32 features + an int64 label a row,
row groups of ``--row-group-rows``), written once in a temp dir, then read as shuffled
batches of ``--batch-size``, the loader alone (no model), each contender in a child
process of its own so that its peak RSS is its own:

- ``stoker``: ``ParquetDataset(path, target="label")`` through ``stoker.build_loader(...,
  shuffle=True)``, as ``data.train: {name: parquet}`` builds it: row groups in a random
  order, rows shuffled within windows of 4 groups (``BlockShuffleSampler``), batches
  cut from the decoded groups;
- ``pyarrow``: what a user writes by hand: ``ParquetFile.iter_batches`` over the row
  groups in a random order into a shuffle buffer of 4 groups' rows, shuffled and cut
  into batches (``torch.from_numpy``), the remainder carried over;
- ``hf``: Hugging Face ``datasets``: ``Dataset.from_parquet`` (converted once to its
  Arrow cache, in the warm-up round; that time is shown apart) ``.with_format("torch")``
  through ``DataLoader(shuffle=True)``, the batch's columns stacked into a feature tensor;
- ``hf_batched``: the same dataset read a whole batch of random indices at a time
  (``DataLoader(sampler=BatchSampler(RandomSampler(ds)), batch_size=None)``).

``hf`` and ``hf_batched`` stop after ``--max-seconds`` (a row at a time is slow); rates
are rows per second of the part read, from the start of the pass (opening the file
included, HF's conversion not). Rows say "not installed" when ``datasets`` is
missing. Contenders alternate round by round after a warm-up round; medians of per-round
ratios; the page cache is warm (the file was just written); load average before and
after. Target: stoker's epoch time / the pyarrow loop's <= 1.03.

    python benchmarks/workloads_parquet.py --out bench-out --rounds 3 --size-mb 300
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Check,
    Result,
    add_common_arguments,
    info,
    interleaved,
    median,
    paired_ratio,
    table,
    target_check,
)

BENCH = "workloads_parquet"
FEATURES = 64
WINDOW = 4  # row groups shuffled together: stoker's BlockShuffleSampler default


def write_parquet(path: Path, *, size_mb: float, row_group_rows: int) -> int:
    """``size_mb`` of random rows, written group by group (never whole in memory)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = max(int(size_mb * 1e6) // (FEATURES * 4 + 8), row_group_rows)
    names = [f"f{j}" for j in range(FEATURES)]
    schema = pa.schema([*(pa.field(n, pa.float32()) for n in names), pa.field("label", pa.int64())])
    rng = np.random.default_rng(0)
    with pq.ParquetWriter(path, schema, use_dictionary=["label"]) as writer:
        for start in range(0, rows, row_group_rows):
            n = min(row_group_rows, rows - start)
            x = rng.standard_normal((n, FEATURES), dtype=np.float32)
            columns = [pa.array(np.ascontiguousarray(x[:, j])) for j in range(FEATURES)]
            y = pa.array(rng.integers(0, 10, size=n, dtype=np.int64))
            writer.write_table(pa.Table.from_arrays([*columns, y], schema=schema))
    return rows


# ---------------------------------------------------------------- the contenders (child)


def stoker_batches(spec: dict) -> Iterator[tuple[Any, Any]]:
    import stoker
    from stoker.data.parquet import ParquetDataset

    dataset = ParquetDataset(spec["path"], target="label")
    yield from stoker.build_loader(dataset, batch_size=spec["batch_size"], shuffle=True, seed=0)


def pyarrow_batches(spec: dict) -> Iterator[tuple[Any, Any]]:
    """iter_batches over the row groups in a random order, through a shuffle buffer."""
    import pyarrow.parquet as pq
    import torch

    file = pq.ParquetFile(spec["path"])
    rng = np.random.default_rng(0)
    groups = rng.permutation(file.num_row_groups).tolist()
    features = [f"f{j}" for j in range(FEATURES)]
    buffer_rows = WINDOW * file.metadata.row_group(0).num_rows
    batch = spec["batch_size"]
    xs: list[np.ndarray] = []
    ys: list[np.ndarray] = []
    held = 0
    for record in file.iter_batches(batch_size=65536, row_groups=groups):
        xs.append(np.column_stack([record.column(n).to_numpy() for n in features]))
        ys.append(record.column("label").to_numpy())
        held += len(ys[-1])
        if held < buffer_rows:
            continue
        x, y = np.concatenate(xs), np.concatenate(ys)
        order = rng.permutation(len(y))
        full = len(y) // batch * batch
        for start in range(0, full, batch):
            take = order[start : start + batch]
            yield torch.from_numpy(x[take]), torch.from_numpy(y[take])
        xs, ys = [x[order[full:]]], [y[order[full:]]]
        held = len(ys[0])
    if held:
        x, y = np.concatenate(xs), np.concatenate(ys)
        order = rng.permutation(len(y))
        for start in range(0, len(y), batch):
            take = order[start : start + batch]
            yield torch.from_numpy(x[take]), torch.from_numpy(y[take])


def hf_dataset(spec: dict) -> Any:
    import datasets

    datasets.disable_progress_bars()
    started, cpu = time.perf_counter(), time.process_time()
    dataset = datasets.Dataset.from_parquet(spec["path"], cache_dir=spec["hf_cache"])
    spec["prepare_s"] = time.perf_counter() - started
    spec["prepare_cpu_s"] = time.process_time() - cpu
    return dataset.with_format("torch")


def hf_stack(batch: dict) -> tuple[Any, Any]:
    import torch

    return torch.stack([batch[f"f{j}"] for j in range(FEATURES)], dim=1), batch["label"]


def hf_batches(spec: dict) -> Iterator[tuple[Any, Any]]:
    from torch.utils.data import DataLoader

    dataset = hf_dataset(spec)
    for batch in DataLoader(dataset, batch_size=spec["batch_size"], shuffle=True):
        yield hf_stack(batch)


def hf_batched_batches(spec: dict) -> Iterator[tuple[Any, Any]]:
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    dataset = hf_dataset(spec)
    sampler = BatchSampler(RandomSampler(dataset), spec["batch_size"], drop_last=False)
    for batch in DataLoader(dataset, sampler=sampler, batch_size=None):
        yield hf_stack(batch)


READERS = {
    "stoker": stoker_batches,
    "pyarrow": pyarrow_batches,
    "hf": hf_batches,
    "hf_batched": hf_batched_batches,
}
#: Imported before the clock starts: a pass is timed, not the start of Python.
IMPORTS = {
    "stoker": ["stoker", "stoker.data.parquet"],
    "pyarrow": ["pyarrow.parquet"],
    "hf": ["datasets", "torch.utils.data"],
    "hf_batched": ["datasets", "torch.utils.data"],
}


def rss_mib(key: str) -> float:
    """``VmHWM`` (peak) or ``VmRSS`` (now) of this process from /proc, in MiB.

    Not ``ru_maxrss``: Linux keeps that across ``exec``, so a child would report the
    parent's peak (here, the writing of the file) when its own is lower.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_child(spec: dict) -> dict:
    """One pass of one contender: rows, seconds, peak RSS (this process's own)."""
    import torch

    torch.set_num_threads(spec["threads"])
    for module in IMPORTS[spec["name"]]:
        importlib.import_module(module)
    baseline = rss_mib("VmRSS")
    rows, started, cpu = 0, time.perf_counter(), time.process_time()

    def elapsed() -> float:  # HF's one-off conversion to its Arrow cache is kept apart
        return time.perf_counter() - started - (spec.get("prepare_s") or 0.0)

    for x, y in READERS[spec["name"]](spec):
        assert x.shape == (len(y), FEATURES) and x.dtype == torch.float32
        rows += len(y)
        if elapsed() > spec["max_seconds"]:
            break
    seconds = elapsed()
    cpu_s = time.process_time() - cpu - (spec.get("prepare_cpu_s") or 0.0)
    return {
        "rows": rows,
        "seconds": seconds,
        "rows_per_s": rows / seconds,
        "cpu_s": cpu_s,
        "peak_rss_mib": rss_mib("VmHWM"),
        "baseline_rss_mib": baseline,
        "prepare_s": spec.get("prepare_s"),
    }


# ---------------------------------------------------------------- parent


def measure(spec: dict) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "HF_DATASETS_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise SystemExit(f"child run {spec['name']} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def datasets_status() -> str:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return "not installed"
    return ""


def parquet_benchmark(path: Path, rows: int, args: argparse.Namespace) -> tuple[dict, list]:
    common = {
        "path": str(path),
        "batch_size": args.batch_size,
        "threads": args.threads,
        "hf_cache": str(path.parent / "hf-cache"),
    }
    full, capped = {"max_seconds": float("inf")}, {"max_seconds": args.max_seconds}
    contenders = {"stoker": full, "pyarrow": full}
    skip_hf = datasets_status()
    if not skip_hf:
        contenders.update({"hf": capped, "hf_batched": capped})
    # The warm-up round converts the file to HF's Arrow cache: its time is kept apart.
    warmup: dict[str, dict] = {}

    def child(name: str, extra: dict):
        def one() -> dict:
            record = measure({**common, **extra, "name": name})
            warmup.setdefault(name, record)
            return record

        return one

    records = interleaved({n: child(n, e) for n, e in contenders.items()}, rounds=args.rounds)
    for name, runs in records.items():
        if name in ("stoker", "pyarrow"):
            assert all(r["rows"] == rows for r in runs), f"{name} did not read every row once"
    rate = {n: [r["rows_per_s"] for r in rs] for n, rs in records.items()}
    rss = {n: median([r["peak_rss_mib"] for r in rs]) for n, rs in records.items()}
    checks: list[Check] = []
    for name in records:
        checks.append(info(BENCH, f"parquet: {name} rate", median(rate[name]), unit="samples/s"))
        checks.append(info(BENCH, f"parquet: {name} peak RSS", rss[name], unit="MiB"))
    checks.append(
        target_check(
            BENCH,
            "parquet: stoker / hand pyarrow loop, epoch time",
            paired_ratio(rate["pyarrow"], rate["stoker"]),
            "<=",
            1.03,
        )
    )
    checks.append(
        info(
            BENCH,
            "parquet: stoker / hand pyarrow loop, CPU time",
            paired_ratio(
                [r["cpu_s"] for r in records["stoker"]], [r["cpu_s"] for r in records["pyarrow"]]
            ),
            unit="x",
            note="the same rows; less sensitive to other jobs than wall time",
        )
    )
    for name in ("hf", "hf_batched"):
        figure = f"parquet: {name} rate / stoker rate"
        if skip_hf:
            checks.append(Check(BENCH, figure, None, status=skip_hf))
        else:
            checks.append(info(BENCH, figure, paired_ratio(rate[name], rate["stoker"]), unit="x"))
    if not skip_hf:
        prepare = warmup["hf"]["prepare_s"] or 0.0
        if warmup["hf_batched"]["prepare_s"] is not None:
            prepare = max(prepare, warmup["hf_batched"]["prepare_s"])
        checks.append(info(BENCH, "parquet: hf from_parquet, first conversion", prepare, unit="s"))
    figures = {"runs": records, "peak_rss_mib": rss, "rows": rows}
    return figures, checks


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # one contender's pass, started by measure()
        print(json.dumps(run_child(json.loads(sys.argv[2]))))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--size-mb", type=float, default=300, help="Parquet file size (MB)")
    parser.add_argument("--row-group-rows", type=int, default=65536)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--max-seconds", type=float, default=5.0, help="cap of the HF runs")
    args = parser.parse_args()
    args.rounds = args.rounds or 3
    with tempfile.TemporaryDirectory(prefix="stoker-parquet-") as tmp:
        path = Path(tmp) / "data.parquet"
        started = time.perf_counter()
        rows = write_parquet(path, size_mb=args.size_mb, row_group_rows=args.row_group_rows)
        print(
            f"wrote {rows:,} rows, {path.stat().st_size / 1e6:.0f} MB "
            f"in {time.perf_counter() - started:.0f} s"
        )
        load_before = os.getloadavg()[0]
        figures, checks = parquet_benchmark(path, rows, args)
        file_mb = path.stat().st_size / 1e6
    checks.append(info(BENCH, "load average 1 min before", load_before))
    checks.append(info(BENCH, "load average 1 min after", os.getloadavg()[0]))
    print(table(checks))
    result = Result(
        benchmark=BENCH,
        timed="rows per second of one pass, opening included (HF's conversion apart); "
        "peak RSS of each contender's own process",
        workload={
            "rows": rows,
            "file_mb": file_mb,
            "features": FEATURES,
            "row_group_rows": args.row_group_rows,
            "batch_size": args.batch_size,
            "shuffle_window_groups": WINDOW,
            "max_seconds_hf": args.max_seconds,
            "threads": args.threads,
            "rounds": args.rounds,
            "page_cache": "warm",
        },
        figures=figures,
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
