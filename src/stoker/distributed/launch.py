"""``stoker train --nproc N``: start N local ranks through torchrun's own launcher.

No launcher or transport of stoker's own: ``torch.distributed.run`` starts the
processes, runs the rendezvous (a c10d store on the loopback interface), restarts the
group on a failure when ``--max-restarts`` allows, and reports which rank failed.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import uuid
from collections.abc import Sequence

from stoker.errors import ConfigError, TrainingError, TrainingInterrupted

logger = logging.getLogger("stoker")

#: Environment that keeps single-node traffic on the loopback interface.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def launch_local(
    worker_argv: Sequence[str], *, nproc: int, max_restarts: int, resume_hint: str = ""
) -> int:
    """Run ``python -m stoker WORKER_ARGV`` on ``nproc`` ranks of this machine.

    Returns 0 when every rank finished. Raises TrainingError naming the failed rank,
    its exit code (or signal) and the restarts tried; TrainingInterrupted when the
    launcher got SIGTERM/SIGINT (torchrun passes it on: the ranks stop after the same
    step and save a checkpoint).
    """
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1; got {nproc}")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be 0 or more; got {max_restarts}")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    arguments = [
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=127.0.0.1:0",
        f"--rdzv-id={uuid.uuid4()}",
        "--local-addr=127.0.0.1",
        "--monitor-interval=0.5",
        "-m",
        "stoker",
        *worker_argv,
    ]
    for name, value in _loopback_env().items():
        os.environ.setdefault(name, value)
    # The agent logs each round and each failure itself; stoker's summary below says it once.
    if not logger.isEnabledFor(logging.DEBUG):
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        torchrun(get_args_parser().parse_args(arguments))
    except ChildFailedError as failed:
        raise TrainingError(_describe_failure(failed, max_restarts=max_restarts)) from None
    except SignalException as stopped:
        raise TrainingInterrupted(
            f"stopped by {_signal_name(stopped.sigval)}: the ranks stopped after the same step "
            "and saved a checkpoint if checkpoints are on (their messages are above)",
            hint=f"resume with: {resume_hint}" if resume_hint else None,
        ) from None
    return 0


def _loopback_env() -> dict[str, str]:
    """Pin gloo/NCCL to ``lo`` when the machine has it (every Linux does)."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return {}
    return LOOPBACK_ENV if "lo" in names else {}


def _describe_failure(failed: object, *, max_restarts: int) -> str:
    """The rank that failed first (the cause), then the others (usually its victims).

    torchrun times a failure to the second, so the cause and its victims often tie: then
    a rank killed by SIGTERM, which is what torchrun sends the survivors, comes after.
    """
    failures = getattr(failed, "failures", {}) or {}
    ordered = sorted(
        failures.items(),
        key=lambda item: (item[1].timestamp, item[1].exitcode == -signal.SIGTERM, item[0]),
    )
    tried = f" after {max_restarts} restart(s)" if max_restarts else ""
    if not ordered:
        return f"distributed run failed{tried}"
    (rank, first), others = ordered[0], ordered[1:]
    message = f"distributed run failed{tried}: rank {rank} (pid {first.pid}) {_how(first)} first"
    if others:
        message += "; then " + ", ".join(f"rank {r} {_how(f)}" for r, f in others)
    return message + "; each rank's own error is printed above"


def _how(failure: object) -> str:
    code = failure.exitcode  # type: ignore[attr-defined]
    return f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def inside_torchrun() -> bool:
    """Whether this process is already one of torchrun's ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ
