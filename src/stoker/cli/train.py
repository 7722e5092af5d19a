"""``stoker train CONFIG [key=value ...]``: train from a YAML run config."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from stoker.cli.options import (
    add_config_and_overrides,
    add_run_flags,
    progress_mode,
    resume_template,
    run_dir_overrides,
)

if TYPE_CHECKING:
    from stoker.config import RunConfig


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    parser = subparsers.add_parser(
        "train",
        parents=parents,
        help="train from a YAML run config",
        description=(
            "Train from a YAML run config. Any key can be overridden as key.sub=value, "
            "anywhere after CONFIG. `--resume RUN_DIR train.epochs=N` extends a run to N "
            "epochs. Relative paths in the config resolve from its folder; those in "
            "overrides and flags from the current folder."
        ),
    )
    add_config_and_overrides(parser, example="train.epochs=2 loader.batch_size=128")
    add_run_flags(parser)
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train on N processes of this machine (DDP through torchrun; gloo on CPU, "
        "NCCL on GPUs); loader.batch_size is per process",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --nproc: when a rank fails, restart the group up to K times, resuming "
        "from the last checkpoint",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # Imported here, so that `stoker --help` does not import torch (see stoker.cli.main).
    from stoker.config import load_config
    from stoker.distributed.launch import inside_torchrun
    from stoker.train.session import train_run

    config = load_config(args.config, [*args.overrides, *run_dir_overrides(args)])
    if args.nproc is not None and not inside_torchrun():
        return _launch(args, config)
    # Under torchrun the run resumes on as many processes as it has now.
    world = os.environ.get("WORLD_SIZE", "1")
    result = train_run(
        config,
        resume=args.resume,
        progress=progress_mode(args),
        resume_hint=_resume_template(args, nproc=int(world) if world not in ("", "1") else None),
        allow_data_change=args.allow_data_change,
        allow_config_change=args.allow_config_change,
    )
    return 0 if result.history else 1


def _launch(args: argparse.Namespace, config: RunConfig) -> int:
    """Start ``--nproc`` ranks that all write one run dir, made here so they agree on it."""
    from stoker.distributed.launch import launch_local
    from stoker.train.rundir import create_run_dir, resume_command

    worker = ["train", args.config, *args.overrides]
    if args.resume:
        run_dir = args.resume
        worker += ["--resume", args.resume]
    else:
        tracking = config.tracking
        run_dir = create_run_dir(tracking.run_dir, root=tracking.runs_root, name=config.name)
        worker += ["--run-dir", str(run_dir)]
    worker += [flag for flag, on in _passed_flags(args) if on]
    worker += ["--progress", args.progress] if not args.quiet else []
    resume = resume_command(_resume_template(args, nproc=args.nproc), run_dir)
    return launch_local(
        worker, nproc=args.nproc, max_restarts=args.max_restarts, resume_hint=resume
    )


def _resume_template(args: argparse.Namespace, *, nproc: int | None) -> str:
    command = ["stoker", "train", args.config, *(["--nproc", str(nproc)] if nproc else [])]
    return resume_template(command, args.overrides)


def _passed_flags(args: argparse.Namespace) -> list[tuple[str, bool]]:
    return [
        ("--allow-data-change", args.allow_data_change),
        ("--allow-config-change", args.allow_config_change),
        ("--quiet", args.quiet),
        ("--debug", args.debug),
    ]
