"""``stoker doctor CONFIG [key=value ...]``: measure each stage, name the bottleneck and the fix."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from typing import TYPE_CHECKING

from stoker.cli.options import add_config_and_overrides
from stoker.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from stoker.observe.doctor import Diagnosis


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker doctor`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "doctor",
        parents=parents,
        help="measure each pipeline stage alone and name the bottleneck",
        description=(
            "Measure the per-sample fetch and collate, the loader alone (at several worker "
            "counts), host-to-device transfer, compute alone (forward, backward, optimizer; "
            "fused and at fewer threads where it matters) and a short real training run; "
            "name the bottleneck (input-bound, partly input-bound, loader-overhead, "
            "collate-bound, oversubscribed, transfer-bound, threads-oversubscribed, "
            "optimizer-bound, balanced, compute-bound); then try each proposed change in a "
            "short run of the pipeline and recommend only one that wins more than 1.05x. "
            "Nothing is written next to the config."
        ),
    )
    add_config_and_overrides(parser, example="loader.num_workers=2")
    parser.add_argument(
        "--seconds",
        type=float,
        default=2.5,
        metavar="S",
        help="time per measurement (default: 2.5); more is steadier on a busy machine",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=16,
        metavar="N",
        help="highest worker count measured besides the configured one (default: 16)",
    )
    parser.add_argument(
        "--no-confirm",
        action="store_true",
        help="skip the short runs that confirm each proposed change (predicted gains only)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document instead of a table"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker doctor``: measure each pipeline stage alone and print the verdict."""
    # Imported here, so that `stoker --help` does not import torch (see stoker.cli.main).
    from rich.console import Console

    from stoker.config import load_config
    from stoker.observe.doctor import run_doctor

    if not (args.seconds > 0 and math.isfinite(args.seconds)):
        raise ConfigError(f"--seconds {args.seconds} must be a positive number", hint="--seconds 2")
    if args.max_workers < 0:
        raise ConfigError(f"--max-workers {args.max_workers} must be >= 0", hint="--max-workers 8")
    config = load_config(args.config, args.overrides)
    err = Console(file=sys.stderr)

    def say(line: str) -> None:
        if not args.json:
            err.print(f"[dim]measuring {line}[/dim]")

    # Whatever the user's code prints while it is measured must not mix with the JSON.
    with contextlib.redirect_stdout(sys.stderr):
        diagnosis = run_doctor(
            config,
            seconds=args.seconds,
            max_workers=args.max_workers,
            confirm=not getattr(args, "no_confirm", False),
            say=say,
        )
    if args.json:
        print(json.dumps(diagnosis.to_dict(), indent=2))
    else:
        print_diagnosis(diagnosis, Console())
    return 0


def _rate(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "∞" if value is not None else "-"
    return f"{value:,.0f}"


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else str(value)


def print_diagnosis(diagnosis: Diagnosis, console: Console) -> None:
    """The table of stages, the verdict and the recommendation."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title="stage ceilings (each measured alone)", title_justify="left")
    table.add_column("stage")
    table.add_column("samples/s", justify="right")
    table.add_column("vs pipeline", justify="right")
    table.add_column("note", overflow="fold")
    for row in diagnosis.stages:
        vs = "-" if row.vs_pipeline is None else f"{row.vs_pipeline:.2f}x"
        table.add_row(row.stage, _rate(row.samples_per_s), vs, Text(row.note))
    console.print(table)
    lines = [
        ("verdict", f"{diagnosis.verdict} (bottleneck: {diagnosis.bottleneck})"),
        ("why", diagnosis.reason),
        ("fix", diagnosis.recommendation),
    ]
    if diagnosis.settings:
        settings = " ".join(f"{k}={_value(v)}" for k, v in diagnosis.settings.items())
        lines.append(("settings", settings))
    if diagnosis.expected_gain is not None:
        kind = (
            "measured in a short run with the change applied"
            if diagnosis.gain_measured
            else "predicted from the stage ceilings, not confirmed"
        )
        lines.append(("expected gain", f"{diagnosis.expected_gain:.2f}x ({kind})"))
    for change in diagnosis.changes:
        if change.settings != diagnosis.settings:
            tried = (
                f"measured {change.confirmed_gain:.2f}x"
                if change.confirmed_gain is not None
                else "not tried"
            )
            lines.append(
                ("also", f"{change.label()}: predicted {change.predicted_gain:.2f}x, {tried}")
            )
    lines.extend(("note", note) for note in diagnosis.warnings)
    for label, text in lines:
        console.print(Text.assemble((f"{label}: ", "bold"), text))
