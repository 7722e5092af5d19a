"""Instructions per training step, counted by callgrind: stoker.fit against hand loops.

Timings on a shared 2-core machine move by more than the few percent the trainer's
bookkeeping costs; instruction counts do not. This runs the trainer benchmark's
contenders (``benchmarks/trainer.py``: the seed MLP, fused Adam, the same loader) under
``valgrind --tool=callgrind`` with instrumentation switched on only around the counted
region (callgrind's client requests, through a small C helper compiled here with the
system's ``valgrind/callgrind.h``), so three contenders take 2-3 minutes.

- ``mean``: (a 3-epoch run - a 1-epoch run) / 314 steps: records, the metrics' fold
  and epoch ends included (what train time sees);
- ``typical``: steps 61-90 of the second epoch, forward to forward: no step record, no
  fold, no epoch end (what a median step sees).

Absolute counts move by up to 3% from process to process (hash seeds, addresses), so
``PYTHONHASHSEED`` is fixed and every contender of one table runs in one process:
compare ratios within a table.

    python benchmarks/step_instructions.py                       # both tables
    python benchmarks/step_instructions.py --contenders hand_same,stoker --kind typical

Needs valgrind and a C compiler (``apt-get install valgrind gcc``).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HELPER = r"""
#include <valgrind/callgrind.h>
void cg_start(void) {
    CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT;
}
void cg_stop(void) {
    CALLGRIND_TOGGLE_COLLECT; CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION;
}
"""
CONTENDERS = ("hand", "hand_same", "hand_checked", "stoker")
STEPS = 157  # 10,000 rows / batch 64
TYPICAL = (61, 30)  # first step, steps


def child(helper: str, kind: str, names: list[str]) -> None:
    """Runs under valgrind: each contender, its regions dumped in order."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch

    torch.set_num_threads(1)
    import trainer
    from common import seed_model

    import stoker
    from stoker.examples.datasets import seed_tabular

    cg = ctypes.CDLL(helper)
    arrays = seed_tabular()
    root = Path(tempfile.mkdtemp())

    def model(counted: bool):
        net = seed_model()
        if counted and kind == "typical":
            first, steps = TYPICAL
            calls = [0]

            def hook(module, args):
                calls[0] += 1
                if calls[0] == STEPS + first:
                    cg.cg_start()
                elif calls[0] == STEPS + first + steps:
                    cg.cg_stop()

            net.register_forward_pre_hook(hook)
        return net

    def run(name: str, epochs: int, counted: bool) -> None:
        net = model(counted)
        loader = stoker.build_loader(arrays, batch_size=64, shuffle=True, seed=0)
        if name == "stoker":
            trainer.stoker_fit(net, arrays, epochs, root)
        else:
            options = {"direct": name != "hand", "checked": name == "hand_checked"}
            trainer.hand_loop(net, loader, epochs, trainer.adam(True), **options)

    for name in names:
        run(name, 1, counted=False)  # warm-up: first calls, lazy imports
        if kind == "typical":
            run(name, 3, counted=True)
        else:
            for epochs in (1, 3):
                cg.cg_start()
                run(name, epochs, counted=False)
                cg.cg_stop()


def _total(dump: Path) -> int:
    for line in dump.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise ValueError(f"no totals in {dump}")


def count(kind: str, names: list[str], work: Path, helper: Path) -> dict[str, float]:
    """Per-step instructions of each contender (one valgrind process for all)."""
    out = work / f"cg-{kind}"
    env = dict(os.environ, PYTHONHASHSEED="0")
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}.%p",
        sys.executable,
        __file__,
        "--child",
        str(helper),
        kind,
        ",".join(names),
    ]
    subprocess.run(command, check=True, env=env, capture_output=True)
    dumps = sorted(work.glob(f"cg-{kind}.*.*"), key=lambda p: int(p.suffix[1:]))
    totals = [_total(d) for d in dumps]
    if kind == "typical":
        return {name: total / TYPICAL[1] for name, total in zip(names, totals, strict=True)}
    pairs = zip(totals[::2], totals[1::2], strict=True)
    return {name: (b - a) / (2 * STEPS) for name, (a, b) in zip(names, pairs, strict=True)}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], sys.argv[4].split(","))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", default="hand_same,hand_checked,stoker")
    parser.add_argument("--kind", choices=("mean", "typical", "both"), default="both")
    args = parser.parse_args()
    names = args.contenders.split(",")
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}: pick from {', '.join(CONTENDERS)}")
    kinds = ("typical", "mean") if args.kind == "both" else (args.kind,)
    with tempfile.TemporaryDirectory(prefix="stoker-cg-") as tmp:
        work = Path(tmp)
        helper = work / "libcg.so"
        (work / "cg.c").write_text(HELPER)
        subprocess.run(
            ["cc", "-O2", "-shared", "-fPIC", "-o", str(helper), str(work / "cg.c")], check=True
        )
        for kind in kinds:
            counts = count(kind, names, work, helper)
            reference = counts[names[0]]
            print(f"{kind} step, instructions (/ {names[0]}):")
            for name, value in counts.items():
                print(f"  {name:14s} {value:12,.0f}  {value / reference:.3f}")


if __name__ == "__main__":
    main()
