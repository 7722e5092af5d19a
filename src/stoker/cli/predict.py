"""``stoker predict RUN_DIR INPUT --out FILE``: write a trained run's predictions."""

from __future__ import annotations

import argparse

from stoker.cli.options import add_weights_flags


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker predict`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "predict",
        parents=parents,
        help="write a trained run's predictions (.parquet, .csv or .npy)",
        description=(
            "Rebuild a run's model from its config.yaml, load its best (or last) weights and "
            "predict every sample of INPUT, batch by batch. INPUT is read with the run's own "
            "data spec (its path argument replaced by INPUT; augmentation off); for a run "
            "whose data spec reads no file (a built-in dataset such as digits), INPUT is a "
            ".npy, .csv or .parquet of the model's inputs, one row per sample. The suffix of "
            "--out picks the format: .parquet or .csv (one row per sample: index, "
            "prediction, probability and label for classification, target when the data has "
            "one) or .npy (the raw outputs, one row per sample)."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run dir a run printed")
    parser.add_argument("input", metavar="INPUT", help="a file or folder of data to predict")
    parser.add_argument(
        "--out",
        metavar="FILE",
        required=True,
        help="the predictions file: .parquet, .csv or .npy",
    )
    add_weights_flags(parser)
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no summary line")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker predict``: write a trained run's predictions and print where."""
    from stoker.inference import predict

    path, rows = predict(
        args.run_dir,
        args.input,
        out=args.out,
        which=args.which,
        device=args.device,
        batch_size=args.batch_size,
        progress=not args.quiet,
    )
    if not args.quiet:
        print(f"wrote {rows:,} predictions ({args.which} weights) to {path}")
    return 0
