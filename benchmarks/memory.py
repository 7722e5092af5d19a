"""Peak memory and throughput of out-of-core sources (.npy memmap, Parquet) against in-memory.

Writes a dataset of about ``--size-gb`` as .npy files and as Parquet (streamed, never
whole in memory), then reads one epoch of each through ``stoker.data.build_loader`` in a
separate child process per run, so every peak RSS is that run's own. Prints a table
and writes JSON.

    python benchmarks/memory.py --size-gb 2 --json memory.json
    python benchmarks/memory.py --size-gb 0.1            # a quick run

A fully shuffled epoch over Parquet decodes nearly every row group for every batch, so
that run stops after ``--max-seconds`` and reports its rate and the projected epoch
time; a block-shuffled epoch (row groups in random order, rows shuffled within windows
of a few groups) shows what a row-group-aware sampler gets.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TARGET_PEAK_RSS_MB = 600  # megabytes (10**6 bytes), for the out-of-core runs
MIB = 2**20


def write_data(folder: Path, *, rows: int, features: int, row_group_rows: int) -> None:
    """features.npy / label.npy and data.parquet, the same values, written chunk by chunk."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    npy = folder / "npy"
    npy.mkdir(parents=True, exist_ok=True)
    # open_memmap writes the headers; rows then go through plain writes (bounded RSS).
    offsets = {}
    for name, dtype, shape in (
        ("features", np.float32, (rows, features)),
        ("label", np.int64, (rows,)),
    ):
        array = np.lib.format.open_memmap(npy / f"{name}.npy", "w+", dtype=dtype, shape=shape)
        offsets[name] = array.offset
        del array
    rng = np.random.default_rng(0)
    names = [f"f{j}" for j in range(features)]
    schema = pa.schema([*(pa.field(n, pa.float32()) for n in names), pa.field("label", pa.int64())])
    with (
        (npy / "features.npy").open("r+b") as xs,
        (npy / "label.npy").open("r+b") as ys,
        # Dictionary pages only for the labels: random floats do not repeat.
        pq.ParquetWriter(folder / "data.parquet", schema, use_dictionary=["label"]) as writer,
    ):
        xs.seek(offsets["features"])
        ys.seek(offsets["label"])
        for start in range(0, rows, row_group_rows):
            n = min(row_group_rows, rows - start)
            x = rng.standard_normal((n, features), dtype=np.float32)
            y = rng.integers(0, 10, size=n, dtype=np.int64)
            xs.write(x.tobytes())
            ys.write(y.tobytes())
            columns = [pa.array(np.ascontiguousarray(x[:, j])) for j in range(features)]
            writer.write_table(pa.Table.from_arrays([*columns, pa.array(y)], schema=schema))


def evict(folder: Path) -> None:
    """Drop the data files from the OS page cache, so the next run reads from disk."""
    for path in folder.rglob("*"):
        if path.is_file() and hasattr(os, "posix_fadvise"):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# ---------------------------------------------------------------- child process


def rss_now() -> dict[str, float]:
    """Current RSS and its anonymous / file-backed parts in MiB (Linux), else {}."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {
        key: int(fields[key].split()[0]) / 1024
        for key in ("VmRSS", "RssAnon", "RssFile")
        if key in fields
    }


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / MIB if sys.platform == "darwin" else peak / 1024


def run_child(spec: dict) -> dict:
    import torch
    from torch.utils.data import Subset

    from stoker.data import ArrayDataset, build_loader
    from stoker.data.memmap import NpyDataset
    from stoker.data.parquet import ParquetDataset

    folder = Path(spec["folder"])
    order = spec["order"]
    if spec["source"] == "npy":
        dataset = NpyDataset(
            folder / "npy", mmap=spec["mmap"], max_mapped_mib=spec["max_mapped_mib"]
        )
    elif spec["source"] == "parquet":
        dataset = ParquetDataset(
            folder / "data.parquet", target="label", cache_row_groups=spec["cache_row_groups"]
        )
    else:  # in-memory: the first rows, copied out of the .npy files
        rows = spec["rows"]
        features = np.load(folder / "npy" / "features.npy", mmap_mode="r")[:rows].copy()
        labels = np.load(folder / "npy" / "label.npy", mmap_mode="r")[:rows].copy()
        dataset = ArrayDataset(features, labels)
    if order == "block-shuffled":
        # Row groups in random order, rows shuffled within windows of `cache` groups;
        # int32 and filled in place, so the index itself adds little to the RSS.
        rng = np.random.default_rng(0)
        bounds = dataset.row_group_offsets()
        window = max(spec["cache_row_groups"], 1)
        groups = rng.permutation(len(bounds) - 1)
        perm = np.empty(bounds[-1], dtype=np.int32)
        filled = 0
        for start in range(0, len(groups), window):
            idx = np.concatenate(
                [
                    np.arange(bounds[g], bounds[g + 1], dtype=np.int32)
                    for g in groups[start : start + window]
                ]
            )
            perm[filled : filled + len(idx)] = rng.permutation(idx)
            filled += len(idx)
        dataset = Subset(dataset, perm)
    loader = build_loader(dataset, batch_size=spec["batch_size"], shuffle=order == "shuffled")
    baseline = rss_now()
    peaks = dict(baseline)
    samples = 0
    started = time.perf_counter()
    partial = False
    for step, batch in enumerate(loader):
        samples += len(batch[0])
        if step % 16 == 0:
            for key, value in rss_now().items():
                peaks[key] = max(peaks.get(key, 0.0), value)
        if time.perf_counter() - started > spec["max_seconds"]:
            partial = True
            break
    seconds = time.perf_counter() - started
    del loader, dataset
    return {
        "samples": samples,
        "epoch_samples": spec["epoch_samples"],
        "seconds": seconds,
        "partial": partial,
        "samples_per_s": samples / seconds,
        "peak_rss_mib": peak_rss_mib(),
        "baseline_rss_mib": baseline.get("VmRSS"),
        "peak_anon_mib": peaks.get("RssAnon"),
        "peak_file_mib": peaks.get("RssFile"),
        "torch_threads": torch.get_num_threads(),
    }


# ---------------------------------------------------------------- parent


def measure(spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"child run {spec['name']} failed:\n{out.stderr}")
    return {**spec, **json.loads(out.stdout.strip().splitlines()[-1])}


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def table(results: list[dict]) -> str:
    """One line per run; ratios are to the in-memory run of the same order (else shuffled)."""
    memory = {r["order"]: r for r in results if r["source"] == "memory"}
    head = (
        f"{'run':<30}{'samples':>10}{'s':>7}{'samples/s':>12}{'x mem':>7}"
        f"{'peak RSS':>10}{'x mem':>7}{'base':>6}{'anon':>6}{'file':>6}  target"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        ref = memory.get(r["order"], memory.get("shuffled"))
        speed = r["samples_per_s"] / ref["samples_per_s"] if ref else float("nan")
        rss = r["peak_rss_mib"] / ref["peak_rss_mib"] if ref else float("nan")
        verdict = {True: "pass", False: "FAIL", None: ""}[r["meets_target"]]
        samples = f"{r['samples']}" + ("*" if r["partial"] else "")
        lines.append(
            f"{r['name']:<30}{samples:>10}{r['seconds']:>7.1f}{r['samples_per_s']:>12,.0f}"
            f"{speed:>7.2f}{r['peak_rss_mib']:>10.0f}{rss:>7.2f}{r['baseline_rss_mib'] or 0:>6.0f}"
            f"{r['peak_anon_mib'] or 0:>6.0f}{r['peak_file_mib'] or 0:>6.0f}  {verdict}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="size of each copy (GB)")
    parser.add_argument("--out", type=Path, help="folder for the data (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--row-group-rows", type=int, default=65536)
    parser.add_argument("--cache-row-groups", type=int, default=4)
    parser.add_argument("--memory-fraction", type=float, default=1 / 8, help="in-memory slice")
    parser.add_argument(
        "--max-seconds", type=float, default=60.0, help="cap of a shuffled Parquet run"
    )
    parser.add_argument(
        "--cold", action="store_true", help="evict the files from the page cache before each run"
    )
    parser.add_argument("--keep", action="store_true", help="keep the data files")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return

    row_bytes = args.features * 4 + 8
    rows = max(int(args.size_gb * 1e9) // row_bytes, args.batch_size)
    memory_rows = max(int(rows * args.memory_fraction), args.batch_size)
    base = Path(tempfile.mkdtemp(prefix="stoker-memory-", dir=args.out))
    print(
        f"writing {rows:,} rows x {args.features} float32 features + int64 label "
        f"({rows * row_bytes / 1e9:.2f} GB per copy) to {base}"
    )
    started = time.perf_counter()
    write_data(base, rows=rows, features=args.features, row_group_rows=args.row_group_rows)
    sizes = {p.name: p.stat().st_size for p in base.rglob("*") if p.is_file()}
    print(f"written in {time.perf_counter() - started:.0f}s: {sizes}")

    common = {
        "folder": str(base),
        "batch_size": args.batch_size,
        "cache_row_groups": args.cache_row_groups,
        "mmap": True,  # NpyDataset's defaults unless a run says otherwise
        "max_mapped_mib": 128,
    }
    full = {"epoch_samples": rows, "max_seconds": float("inf")}
    memory = {"rows": memory_rows, "epoch_samples": memory_rows, "max_seconds": float("inf")}
    capped = {**full, "max_seconds": args.max_seconds}
    plan = [
        ("memory ArrayDataset shuffled", "memory", "shuffled", memory),
        ("memory ArrayDataset sequential", "memory", "sequential", memory),
        ("npy memmap shuffled", "npy", "shuffled", full),
        ("npy memmap sequential", "npy", "sequential", full),
        ("npy by-position shuffled", "npy", "shuffled", {**full, "mmap": False}),
        ("npy by-position sequential", "npy", "sequential", {**full, "mmap": False}),
        ("parquet sequential", "parquet", "sequential", full),
        ("parquet block-shuffled", "parquet", "block-shuffled", full),
        ("parquet shuffled", "parquet", "shuffled", capped),
    ]
    runs = [{"name": n, "source": src, "order": o, **extra} for n, src, o, extra in plan]
    target_mib = TARGET_PEAK_RSS_MB * 1e6 / MIB
    results = []
    for run in runs:
        if args.cold:
            evict(base)
        result = measure({**common, **run})
        out_of_core = result["source"] != "memory"
        result["meets_target"] = result["peak_rss_mib"] < target_mib if out_of_core else None
        results.append(result)
        print(
            f"  {run['name']}: {result['samples_per_s']:,.0f} samples/s, "
            f"peak RSS {result['peak_rss_mib']:.0f} MiB"
        )
    print()
    print(table(results))
    print(
        f"\n* stopped after --max-seconds={args.max_seconds:g}; projected epoch time: "
        + ", ".join(
            f"{r['name']} {duration(r['epoch_samples'] / r['samples_per_s'])}"
            for r in results
            if r["partial"]
        )
        if any(r["partial"] for r in results)
        else ""
    )
    print(
        f"target: peak RSS < {TARGET_PEAK_RSS_MB} MB ({target_mib:.0f} MiB) for the out-of-core "
        f"runs; in-memory holds {memory_rows:,} of {rows:,} rows "
        f"({memory_rows * row_bytes / MIB:.0f} MiB); the whole set in memory would need "
        f"about {rows * row_bytes / MIB:.0f} MiB more than the baseline. Page cache: "
        f"{'evicted before each run' if args.cold else 'warm (files just written)'}."
    )
    report = {
        "size_gb": args.size_gb,
        "rows": rows,
        "features": args.features,
        "batch_size": args.batch_size,
        "row_group_rows": args.row_group_rows,
        "cache_row_groups": args.cache_row_groups,
        "file_bytes": sizes,
        "page_cache": "cold" if args.cold else "warm",
        "target_peak_rss_mb": TARGET_PEAK_RSS_MB,
        "failed_runs": [r["name"] for r in results if r["meets_target"] is False],
        "runs": results,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.json}")
    if not args.keep:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
