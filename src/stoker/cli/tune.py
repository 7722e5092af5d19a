"""``stoker tune CONFIG [key=value ...]``: search the settings that speed training (the
loader's, a cache, the fused optimizer, the thread count), optionally write them."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import time
from typing import TYPE_CHECKING

from stoker.cli.options import add_config_and_overrides
from stoker.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from stoker.observe.tune import TuneResult


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker tune`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "tune",
        parents=parents,
        help="search the settings that speed training (loader, cache, fused optimizer, threads)",
        description=(
            "Search num_workers, prefetch_factor, persistent_workers, pin_memory (CUDA only) "
            "and batched fetch by successive halving over the loader alone; then race short "
            "training runs of the whole pipeline: the best loader candidates and the "
            "doctor's other changes (data.cache=memory, optim.fused=true, train.threads), "
            "each briefly, then the configured settings and the best one again, longer. "
            "The speed-up it predicts is the one those runs show over the run's epochs."
        ),
    )
    add_config_and_overrides(parser, example="loader.num_workers=2")
    parser.add_argument(
        "--write",
        action="store_true",
        help="save the winning settings (loader.*, data.cache, optim.fused, train.threads) "
        "into CONFIG (comments, order and style kept)",
    )
    parser.add_argument(
        "--batch-size",
        action="store_true",
        help="also search loader.batch_size (it changes the optimisation, not only the speed: "
        "scale the learning rate with it)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=60.0,
        metavar="S",
        help="total time to spend, search and confirming runs (default: 60)",
    )
    parser.add_argument(
        "--no-confirm",
        action="store_true",
        help="skip the training runs (the fastest loader alone wins; no other change is "
        "tried and no speed-up is predicted)",
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=16,
        metavar="N",
        help="highest worker count tried besides the configured one (default: 16)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON document instead of a table"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker tune``: search the loader settings; ``--write`` saves them."""
    # Imported here, so that `stoker --help` does not import torch (see stoker.cli.main).
    from rich.console import Console
    from rich.text import Text

    from stoker.config import load_config
    from stoker.observe.tune import import_optimizer_stack, tune, write_settings

    if not (args.budget_s > 0 and math.isfinite(args.budget_s)):
        raise ConfigError(
            f"--budget-s {args.budget_s} must be a positive number", hint="--budget-s 60"
        )
    config = load_config(args.config, args.overrides)
    err = Console(file=sys.stderr)

    def say(line: str) -> None:
        if not args.json:
            err.print(Text(f"tuning: {line}", style="dim"))

    import_optimizer_stack()  # a one-off cost of the process, before the budget's clock
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        result = tune(
            config,
            budget_s=args.budget_s,
            batch_size=args.batch_size,
            confirm=not args.no_confirm,
            max_workers=args.max_workers,
            say=say,
        )
    elapsed = time.perf_counter() - started
    changes = write_settings(args.config, result.settings) if args.write else {}
    if args.json:
        document = result.to_dict()
        document["written"] = {k: {"old": o, "new": n} for k, (o, n) in changes.items()}
        document["elapsed_s"] = elapsed
        print(json.dumps(_finite(document), indent=2))
        return 0
    console = Console()
    print_result(result, console)
    console.print(Text(f"took {elapsed:.1f} s (budget {args.budget_s:g} s)"))
    if args.write:
        if changes:
            listed = ", ".join(f"{k}: {_yaml(o)} -> {_yaml(n)}" for k, (o, n) in changes.items())
            console.print(Text(f"updated {args.config}: {listed}"))
        else:
            console.print(Text(f"{args.config} already has the best settings measured"))
    elif result.settings:
        keys = " ".join(f"{k}={_yaml(v)}" for k, v in result.settings.items())
        console.print(
            Text(
                f"apply: stoker tune {shlex.quote(args.config)} --write, "
                f"or train with: stoker train {shlex.quote(args.config)} {keys}"
            )
        )
    return 0


def _yaml(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _finite(value: object) -> object:
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def print_result(result: TuneResult, console: Console) -> None:
    """The candidates table, the winner, the confirmation and the notes."""
    from rich.table import Table
    from rich.text import Text

    halving = result.halving
    table = Table(
        title=(
            f"loader candidates (successive halving: {halving.spent_s:.1f} s measured, "
            f"{result.search_s:.1f} s wall)"
        ),
        title_justify="left",
    )
    table.add_column("candidate")
    table.add_column("rounds", justify="right")
    table.add_column("samples/s", justify="right")
    table.add_column("status")
    rows = list(dict.fromkeys(t.candidate for t in halving.trials))
    rows.sort(key=lambda c: -(halving.last_trial(c).samples_per_s or 0.0))  # type: ignore[union-attr]
    for candidate in rows:
        trial = halving.last_trial(candidate)
        assert trial is not None
        status = halving.status(candidate)
        if candidate == result.baseline:
            status += " (current)"
        table.add_row(
            candidate.label(), str(trial.round + 1), f"{trial.samples_per_s:,.0f}", status
        )
    console.print(table)
    winner = halving.last_trial(halving.winner)
    baseline = halving.last_trial(result.baseline)
    line = f"fastest loader alone: {halving.winner.label()}"
    if winner is not None and baseline is not None and baseline.samples_per_s > 0:
        line += (
            f" (the loader alone, no model: {winner.samples_per_s:,.0f} samples/s vs "
            f"{baseline.samples_per_s:,.0f} now; training sets the pace, see below)"
        )
    console.print(Text(line))
    if result.race is not None:
        runs = Table(
            title="short training runs (rates over the run's epochs)", title_justify="left"
        )
        for column in ("candidate", "round", "steps", "samples/s"):
            runs.add_column(column, justify="left" if column == "candidate" else "right")
        for run in result.race.runs:
            current = " (current)" if run.candidate == result.baseline else ""
            label = run.candidate.label() + current
            cut = " (cut short)" if run.figures.cut_short else ""
            runs.add_row(label, str(run.round), str(run.figures.steps), f"{run.rate:,.0f}{cut}")
        console.print(runs)
    if result.baseline_pipeline is not None and result.winner_pipeline is not None:
        base = result.baseline_pipeline.run_rate(result.epochs)
        win = result.winner_pipeline.run_rate(result.epochs)
        console.print(
            Text(
                f"training (short runs, rates over the run's {result.epochs} epoch(s), "
                f"start-up and a cache's fill included): {win:,.0f} samples/s with the "
                f"winner vs {base:,.0f} now ({result.pipeline_gain or 0:.2f}x)"
            )
        )
    console.print(Text(f"winner: {result.winner.label()}"))
    if result.settings and result.predicted_gain is not None:
        console.print(Text(f"expected speed-up of training: {result.predicted_gain:.2f}x"))
    for note in result.notes:
        console.print(Text(f"note: {note}"))
