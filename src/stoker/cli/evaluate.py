"""``stoker evaluate RUN_DIR [--data PATH]``: a trained run's metrics on its or other data."""

from __future__ import annotations

import argparse
from pathlib import Path

from stoker.cli.options import add_weights_flags


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker evaluate`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "evaluate",
        parents=parents,
        help="a trained run's metrics on its validation data or on --data",
        description=(
            "Rebuild a run's model from its config.yaml, load its best (or last) weights and "
            "compute the loss and the task's metrics (accuracy; MSE and MAE) on its "
            "validation data or on --data, with the same code as validation in training. "
            "Prints the metrics and writes them as JSON (RUN_DIR/eval-<which>.json, or --out)."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run dir a run printed")
    parser.add_argument(
        "--data",
        metavar="PATH",
        help="a file or folder in the form of the run's data (default: its validation data)",
    )
    parser.add_argument("--out", metavar="FILE", help="write the metrics (JSON) here")
    add_weights_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker evaluate``: print a trained run's metrics and write them to its run dir."""
    from stoker.inference import evaluate_run, write_evaluation

    result = evaluate_run(
        args.run_dir,
        data=args.data,
        which=args.which,
        device=args.device,
        batch_size=args.batch_size,
    )
    suffix = f"-{Path(args.data).stem}" if args.data else ""
    out = args.out or Path(args.run_dir) / f"eval-{args.which}{suffix}.json"
    path = write_evaluation(result, out)
    epoch = f", epoch {result['epoch']}" if result["epoch"] is not None else ""
    print(f"{args.which} weights{epoch} on {result['data']} ({result['samples']} samples):")
    for key, value in result["metrics"].items():
        print(f"  {key}: {value:.6g}" if isinstance(value, float) else f"  {key}: {value}")
    print(f"wrote {path}")
    return 0
