"""GPU figures for the GPU check (run by gpu_check.sh): copies, overlap, data stall, bf16, compile.

Each part runs on its own; a part that fails is reported with its error and the
others still run. Prints a short table last and writes ``<out>/gpu_check.json``.

1. Host-to-device copy of a 256 MiB tensor, pinned vs pageable: GB/s (CUDA events,
   median of 10).
2. Copy overlap: a step that copies a 64 MiB batch and computes on it for about the
   copy's time again. Step time with the batch already on the device (compute only),
   copied in the compute stream (``move_to_device``: no overlap), and delivered by
   ``stoker.data.prefetch.DevicePrefetcher`` (side stream). Visible share of the copy
   = (prefetched − compute only) / (copied in stream − compute only); 0 is full overlap.
3. Data stall on an input-heavy workload (each sample does ~3000 Python iterations,
   small MLP on the GPU): ``stoker.fit`` with the default loader, then with the
   settings ``stoker.observe.tune.tune`` finds (what ``stoker tune`` writes);
   ``time/data_stall_pct`` of each run's last epoch.
4. bf16 autocast and torch.compile on a mid-size model (6-layer transformer encoder,
   d_model 512, 128 tokens, batch 64, data resident on the GPU): ``stoker.fit`` with
   precision fp32, bf16, and bf16 + compile; steady wall time per step (epoch time /
   steps, first epoch — compilation — left out) and speed-ups.

    python benchmarks/gpu_check.py --out gpu-check-out
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BusySamples

MIB = 2**20


# ------------------------------------------------------------------ 1. copies


def copy_bandwidth(device: torch.device, *, mib: int = 256, repeats: int = 10) -> dict:
    """Host-to-device GB/s from pinned and from pageable memory."""
    numel = mib * MIB // 4
    out = {}
    for kind in ("pinned", "pageable"):
        host = torch.randn(numel)
        if kind == "pinned":
            host = host.pin_memory()
        host.to(device, non_blocking=True)  # warm-up (allocator, staging buffers)
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            host.to(device, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        out[f"{kind}_gb_per_s"] = host.numel() * 4 / statistics.median(times) / 1e9
    out["pinned_over_pageable"] = out["pinned_gb_per_s"] / out["pageable_gb_per_s"]
    return out


# ------------------------------------------------------------------ 2. overlap


def copy_overlap(device: torch.device, *, steps: int = 40, batch_mib: int = 64) -> dict:
    """How much of the host-to-device copy the side-stream prefetcher hides."""
    from stoker.data.device import move_to_device
    from stoker.data.prefetch import DevicePrefetcher

    rows = 1024
    cols = batch_mib * MIB // 4 // rows
    host = [torch.randn(rows, cols).pin_memory() for _ in range(4)]
    weight = torch.randn(cols, 1024, device=device) / cols**0.5
    square = torch.randn(1024, 1024, device=device) / 32

    def compute(batch: torch.Tensor, repeats: int) -> torch.Tensor:
        h = batch @ weight
        for _ in range(repeats):
            h = torch.tanh(h @ square)
        return h.sum()

    def timed(batches: Callable[[], Any], repeats: int) -> float:
        for batch in batches():  # warm-up pass
            compute(batch, repeats)
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for batch in batches():
            compute(batch, repeats)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - started) / steps

    resident = host[0].to(device)

    def on_device():
        return (resident for _ in range(steps))

    def in_stream():
        return (move_to_device(host[i % 4], device) for i in range(steps))

    def prefetched():
        return DevicePrefetcher(device).wrap(host[i % 4] for i in range(steps))

    # The copy alone, then enough compute per step to take about as long again.
    copy_s = timed(in_stream, 0) - timed(on_device, 0)
    repeats = 1
    while timed(on_device, repeats) < 1.5 * max(copy_s, 1e-5) and repeats < 4096:
        repeats *= 2
    compute_s = timed(on_device, repeats)
    serial_s = timed(in_stream, repeats)
    overlapped_s = timed(prefetched, repeats)
    hidden = serial_s - compute_s
    return {
        "batch_mib": batch_mib,
        "compute_repeats": repeats,
        "copy_only_step_s": copy_s,
        "compute_only_step_s": compute_s,
        "copy_in_stream_step_s": serial_s,
        "prefetched_step_s": overlapped_s,
        "visible_copy_share": (overlapped_s - compute_s) / hidden if hidden > 0 else None,
    }


# ------------------------------------------------------------------ 3. data stall


def small_mlp(features: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, 256), nn.ReLU(), nn.Linear(256, 2))


def data_stall(device: torch.device, *, steps: int, budget_s: float, work: int) -> dict:
    """Data stall % with the default loader and with the tuner's settings."""
    import stoker
    from stoker.config import config_from_options
    from stoker.observe.tune import tune
    from stoker.train.pipeline import UserComponents

    data = BusySamples(n=16384, features=32, work=work)
    options: dict[str, Any] = {
        "device": str(device),
        "epochs": 1,
        "max_steps": steps,
        "batch_size": 64,
        "tensorboard": False,
        "enabled": False,  # checkpoint.enabled
        "fingerprint": "off",
    }
    root = Path(tempfile.mkdtemp(prefix="stoker-gpu-check-"))

    def run(settings: dict) -> dict:
        result = stoker.fit(
            small_mlp(),
            data,
            progress="quiet",
            run_dir=tempfile.mkdtemp(dir=root),
            **options,
            **settings,
        )
        last = result.history[-1]
        return {
            key: last.get(key)
            for key in ("time/data_stall_pct", "time/step_s", "throughput/samples_per_s")
        }

    default = run({})
    config = config_from_options({**options, "run_dir": str(root / "tune")})
    started = time.perf_counter()
    found = tune(config, budget_s=budget_s, user=UserComponents(model=small_mlp(), train_data=data))
    tune_s = time.perf_counter() - started
    # The tuner's dotted keys as stoker.fit's flat options (loader.num_workers -> num_workers).
    tuned = run({key.split(".", 1)[1]: value for key, value in found.settings.items()})
    return {
        "steps": steps,
        "work_per_sample": work,
        "default": default,
        "tuned_settings": found.settings,
        "tuner_winner": found.winner.label(),
        "tuner_rejected": found.rejected,
        "tune_s": tune_s,
        "tuned": tuned,
    }


# ------------------------------------------------------------------ 4. bf16, compile


class Encoder(nn.Module):
    """A mid-size transformer classifier: 6 pre-norm encoder layers, mean-pooled."""

    def __init__(self, d_model: int = 512, layers: int = 6, classes: int = 10) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(
            d_model, 8, 4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(dim=1))


def precision_and_compile(
    device: torch.device, *, samples: int, tokens: int, epochs: int, variants: list[str]
) -> dict:
    """Steady step time of stoker.fit in fp32, bf16, bf16 + torch.compile."""
    import stoker
    from stoker.data.sources import ArrayDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, tokens, 512, generator=generator)
    y = torch.randint(0, 10, (samples,), generator=generator)
    data = ArrayDataset(x.to(device), y.to(device))  # resident: the model's speed alone
    settings = {
        "fp32": {"precision": "fp32"},
        "bf16": {"precision": "bf16"},
        "bf16+compile": {"precision": "bf16", "compile": True},
        "fp32+compile": {"precision": "fp32", "compile": True},
    }
    root = Path(tempfile.mkdtemp(prefix="stoker-gpu-check-"))
    out: dict[str, Any] = {"samples": samples, "tokens": tokens, "batch_size": 64}
    for name in variants:
        torch.manual_seed(0)
        started = time.perf_counter()
        result = stoker.fit(
            Encoder(),
            data,
            device=str(device),
            epochs=epochs,
            batch_size=64,
            lr=3e-4,
            pin_memory=False,  # the data already lives on the GPU
            fingerprint="off",
            tensorboard=False,
            enabled=False,
            progress="quiet",
            run_dir=tempfile.mkdtemp(dir=root),
            **settings[name],
        )
        steady = result.history[1:] or result.history
        steps = -(-samples // 64)
        out[name] = {
            "wall_s": time.perf_counter() - started,
            "first_epoch_s": result.history[0]["time/epoch_s"],
            "step_s": statistics.median(r["time/epoch_s"] for r in steady) / steps,
            "stoker_step_s": statistics.median(r["time/step_s"] for r in steady),
            "loss": result.metrics.get("train/loss"),
        }
    if "fp32" in out and "bf16" in out:
        out["bf16_speedup"] = out["fp32"]["step_s"] / out["bf16"]["step_s"]
    if "bf16" in out and "bf16+compile" in out:
        out["compile_speedup_over_bf16"] = out["bf16"]["step_s"] / out["bf16+compile"]["step_s"]
    return out


# ------------------------------------------------------------------ driver


def attempt(name: str, results: dict, fn: Callable[[], dict]) -> None:
    print(f"[gpu_check] {name} ...", flush=True)
    started = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as error:  # one part failing must not hide the others
        results[name] = {"error": f"{type(error).__name__}: {error}"}
        traceback.print_exc()
    results[name]["seconds"] = round(time.perf_counter() - started, 1)
    print(f"[gpu_check] {name} done in {results[name]['seconds']} s", flush=True)


def rows(results: dict) -> list[tuple[str, str]]:
    def get(part: str, *keys: str) -> Any:
        value: Any = results.get(part, {})
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def fmt(value: Any, pattern: str) -> str:
        return "-" if value is None else pattern.format(value)

    table = []
    for part in ("copies", "overlap", "data_stall", "precision"):
        if "error" in results.get(part, {}):
            table.append((part, "ERROR " + results[part]["error"][:70]))
    table += [
        ("H2D pinned", fmt(get("copies", "pinned_gb_per_s"), "{:.1f} GB/s")),
        ("H2D pageable", fmt(get("copies", "pageable_gb_per_s"), "{:.1f} GB/s")),
        ("pinned / pageable", fmt(get("copies", "pinned_over_pageable"), "{:.2f}x")),
        (
            "copy time visible with prefetcher",
            fmt(get("overlap", "visible_copy_share"), "{:.0%}"),
        ),
        (
            "data stall, default loader",
            fmt(get("data_stall", "default", "time/data_stall_pct"), "{:.1f}%"),
        ),
        (
            "data stall, stoker tune's settings",
            fmt(get("data_stall", "tuned", "time/data_stall_pct"), "{:.1f}%"),
        ),
        ("tuned settings", str(get("data_stall", "tuned_settings") or "none (defaults kept)")),
        ("tuner's winner", str(get("data_stall", "tuner_winner") or "-")),
        ("bf16 autocast speed-up (vs fp32)", fmt(get("precision", "bf16_speedup"), "{:.2f}x")),
        (
            "torch.compile speed-up (bf16)",
            fmt(get("precision", "compile_speedup_over_bf16"), "{:.2f}x"),
        ),
    ]
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tune-budget-s", type=float, default=40.0)
    parser.add_argument("--stall-steps", type=int, default=300)
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run parts 3 and 4 tiny on the CPU (checks the script, not the GPU)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cpu_smoke:
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("gpu_check.py: no CUDA device visible to PyTorch", file=sys.stderr)
        return 1
    else:
        device = torch.device("cuda")

    results: dict[str, Any] = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else None,
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
    }
    if device.type == "cuda":
        attempt("copies", results, lambda: copy_bandwidth(device))
        attempt("overlap", results, lambda: copy_overlap(device))
    smoke = args.cpu_smoke
    attempt(
        "data_stall",
        results,
        lambda: data_stall(
            device,
            steps=10 if smoke else args.stall_steps,
            budget_s=4.0 if smoke else args.tune_budget_s,
            work=300 if smoke else 3000,
        ),
    )
    attempt(
        "precision",
        results,
        lambda: precision_and_compile(
            device,
            samples=128 if smoke else 2048,
            tokens=8 if smoke else 128,
            epochs=2 if smoke else 3,
            variants=["fp32", "bf16"] if smoke else ["fp32", "bf16", "bf16+compile"],
        ),
    )
    path = args.out / "gpu_check.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(f"\nwrote {path}")
    table = rows(results)
    width = max(len(name) for name, _ in table)
    print(f"\nGPU check: {results['machine']['gpu']} | torch {torch.__version__}")
    for name, value in table:
        print(f"  {name:<{width}}  {value}")
    failed = [
        part for part, value in results.items() if isinstance(value, dict) and "error" in value
    ]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
