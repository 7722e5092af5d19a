"""Command-line flags shared by the subcommands that train."""

from __future__ import annotations

import argparse


def add_run_flags(parser: argparse.ArgumentParser) -> None:
    """``--resume``, ``--run-dir`` and how progress is shown."""
    parser.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint",
    )
    parser.add_argument(
        "--run-dir",
        metavar="DIR",
        help="write the run here instead of runs/<name>-<timestamp>",
    )
    parser.add_argument(
        "--allow-data-change",
        action="store_true",
        help="with --resume: continue even though the training data's fingerprint changed",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue although batch size, workers, seed or another setting "
        "the exact resume depends on changed",
    )
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument("--quiet", action="store_true", help="print nothing but errors")
    shown.add_argument(
        "--progress",
        choices=("auto", "rich", "plain"),
        default="auto",
        help="progress display: a live bar on a terminal (auto), or plain lines",
    )


def progress_mode(args: argparse.Namespace) -> str:
    return "quiet" if args.quiet else args.progress


def run_dir_overrides(args: argparse.Namespace) -> list[str]:
    """``--run-dir`` as a config override, so the resolved config records it."""
    return [f"tracking.run_dir={args.run_dir}"] if args.run_dir else []
