"""``stoker train CONFIG [key=value ...]``: train from a YAML run config."""

from __future__ import annotations

import argparse
import os
import shlex

from stoker.cli.options import add_run_flags, progress_mode, run_dir_overrides
from stoker.config import RunConfig, load_config
from stoker.distributed.launch import inside_torchrun, launch_local
from stoker.train.rundir import create_run_dir
from stoker.train.session import train_run


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    parser = subparsers.add_parser(
        "train",
        parents=parents,
        help="train from a YAML run config",
        description="Train from a YAML run config. Any key can be overridden as key.sub=value.",
    )
    parser.add_argument("config", metavar="CONFIG", help="the run config (YAML)")
    parser.add_argument(
        "overrides",
        metavar="KEY=VALUE",
        nargs="*",
        help="config overrides, e.g. train.epochs=2 loader.batch_size=128",
    )
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
    config = load_config(args.config, [*args.overrides, *run_dir_overrides(args)])
    if args.nproc is not None and not inside_torchrun():
        return _launch(args, config)
    # Under torchrun the run resumes on as many processes as it has now.
    world = os.environ.get("WORLD_SIZE", "1")
    nproc = f" --nproc {world}" if world not in ("", "1") else ""
    resume_hint = f"stoker train {shlex.quote(args.config)}{nproc} --resume {{run_dir}}"
    result = train_run(
        config,
        resume=args.resume,
        progress=progress_mode(args),
        resume_hint=resume_hint,
        allow_data_change=args.allow_data_change,
        allow_config_change=args.allow_config_change,
    )
    return 0 if result.history else 1


def _launch(args: argparse.Namespace, config: RunConfig) -> int:
    """Start ``--nproc`` ranks that all write one run dir, made here so they agree on it."""
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
    resume = f"stoker train {shlex.quote(args.config)} --nproc {args.nproc} --resume {run_dir}"
    return launch_local(
        worker, nproc=args.nproc, max_restarts=args.max_restarts, resume_hint=resume
    )


def _passed_flags(args: argparse.Namespace) -> list[tuple[str, bool]]:
    return [
        ("--allow-data-change", args.allow_data_change),
        ("--allow-config-change", args.allow_config_change),
        ("--quiet", args.quiet),
        ("--debug", args.debug),
    ]
