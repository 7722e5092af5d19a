"""``stoker report RUN_DIR``: write a run's self-contained HTML report."""

from __future__ import annotations

import argparse
import logging
import webbrowser

logger = logging.getLogger("stoker")


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker report`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "report",
        parents=parents,
        help="write a run's HTML report (charts, timing, config, environment)",
        description=(
            "Write one self-contained HTML page for a run: loss, accuracy, learning rate, "
            "gradient norm and throughput curves, where each epoch's time went, the timing "
            "verdict, the resolved config and the environment. It needs no network to view."
        ),
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run dir to report on")
    parser.add_argument(
        "--out", metavar="FILE", help="write the report here (default: RUN_DIR/report.html)"
    )
    parser.add_argument(
        "--open", action="store_true", help="open the report in the default web browser"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker report``: write a run's HTML report (and open it with ``--open``)."""
    from stoker.observe.report import write_report

    path = write_report(args.run_dir, out=args.out)
    print(path)
    if args.open and not webbrowser.open(path.resolve().as_uri()):
        # Not an error: the report is written; a headless machine just has no browser.
        logger.warning("could not start a web browser; open %s yourself", path)
    return 0
