"""``stoker train CONFIG [key=value ...]``: train from a YAML run config."""

from __future__ import annotations

import argparse
import shlex

from stoker.cli.options import add_run_flags, progress_mode, run_dir_overrides
from stoker.config import load_config
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
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config, [*args.overrides, *run_dir_overrides(args)])
    resume_hint = f"stoker train {shlex.quote(args.config)} --resume {{run_dir}}"
    result = train_run(
        config,
        resume=args.resume,
        progress=progress_mode(args),
        resume_hint=resume_hint,
        allow_data_change=args.allow_data_change,
        allow_config_change=args.allow_config_change,
    )
    return 0 if result.history else 1
