"""``stoker demo``: train the built-in default (handwritten digits) end to end."""

from __future__ import annotations

import argparse
from importlib import resources

from stoker.cli.options import add_run_flags, progress_mode, resume_template, run_dir_overrides


def demo_config_path() -> str:
    """The packaged config of the demo (``examples/digits.yaml`` is the same file)."""
    return str(resources.files("stoker.examples").joinpath("digits.yaml"))


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker demo`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "demo",
        parents=parents,
        help="train the built-in digits classifier (no download)",
        description=(
            "Train a small classifier on the handwritten digits that scikit-learn ships, "
            "with no download: the whole pipeline end to end in seconds."
        ),
    )
    parser.add_argument("--epochs", type=int, help="number of epochs (default: the config's)")
    parser.add_argument(
        "overrides", metavar="KEY=VALUE", nargs="*", help="config overrides, as for train"
    )
    add_run_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker demo``: train the built-in digits classifier."""
    from stoker.config import load_config
    from stoker.train.session import train_run

    overrides = list(args.overrides) + run_dir_overrides(args)
    if args.epochs is not None:
        overrides.append(f"train.epochs={args.epochs}")
    config = load_config(demo_config_path(), overrides)
    epochs = ["--epochs", str(args.epochs)] if args.epochs is not None else []
    result = train_run(
        config,
        resume=args.resume,
        progress=progress_mode(args),
        allow_data_change=args.allow_data_change,
        allow_config_change=args.allow_config_change,
        # The same epochs and overrides again: the demo's cosine spans the whole run.
        resume_hint=resume_template(["stoker", "demo", *epochs], args.overrides),
    )
    return 0 if result.history else 1
