"""How long an FSDP checkpoint save blocks training: synchronous vs ``checkpoint.async_save``.

Two ranks (gloo, CPU) shard a 4-layer MLP of ``--width`` with ``fully_shard``, take one
Adam step, then save ``--rounds`` times each way, alternating, through stoker's own
pieces (``ShardedWeights`` and, on rank 0, the ``Checkpointer``). Per save it times the
call the training thread is blocked in (rank 0: ``Checkpointer.save``) and, for async,
the time until the checkpoint is complete (``ShardedWeights.settle``). The first round
warms up (imports, the save group) and is not counted; medians are printed.

    OMP_NUM_THREADS=1 python benchmarks/async_save.py --width 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, folder: str, width: int, rounds: int) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from stoker.checkpoint import Checkpointer
    from stoker.config import DistributedConfig
    from stoker.distributed.fsdp import ShardedWeights, shard_model
    from stoker.distributed.runtime import Distributed

    dist = Distributed.start(DistributedConfig(), device_name="cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    model = shard_model(model, device=torch.device("cpu"), world_size=world)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, width)).sum().backward()
    optimizer.step()
    checkpointer = Checkpointer(folder, keep_last=2, monitor=None) if rank == 0 else None
    times: dict[str, list[float]] = {"sync": [], "async": [], "async, until complete": []}
    step = 0
    for round_ in range(rounds + 1):
        for mode in ("sync", "async"):
            weights = ShardedWeights(dist, checkpoints=Path(folder), async_save=mode == "async")
            step += 1
            dist.barrier()
            start = time.perf_counter()
            if checkpointer is not None:
                write = weights.write_first(model, optimizer)
                checkpointer.save({"step": step}, epoch=0, step=step, write_first=write)
            else:
                weights.join_write(model, optimizer)
            blocked = time.perf_counter() - start
            weights.settle(checkpointer)
            if round_:
                times[mode].append(blocked)
                if mode == "async":
                    times["async, until complete"].append(time.perf_counter() - start)
    if checkpointer is not None:
        params = sum(p.numel() for p in model.parameters())  # DTensors: the global size
        print(f"width {width}: {params / 1e6:.1f} M parameters, ", end="")
        print(f"{params * 12 / 2**20:.0f} MiB with Adam's state per checkpoint")
        medians = {mode: statistics.median(values) for mode, values in times.items()}
        for mode, values in times.items():
            runs = ", ".join(f"{v * 1000:.0f}" for v in values)
            print(f"  {mode:24s} {medians[mode] * 1000:7.1f} ms  (runs: {runs})")
        print(f"  blocked, async / sync: {medians['async'] / medians['sync']:.3f}")
        checkpointer.close()
    dist.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_rank, args=(2, port, folder, args.width, args.rounds), nprocs=2)


if __name__ == "__main__":
    main()
