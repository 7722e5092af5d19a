"""``stoker config show|validate CONFIG [key=value ...]``: a run config, resolved or checked."""

from __future__ import annotations

import argparse
import sys

from stoker.cli.options import add_config_and_overrides


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker config`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "config",
        parents=parents,
        help="print a run config resolved, or check it without running",
        description=(
            "Look at a run config as a run would read it: overrides applied, relative paths "
            "resolved from the config's folder, every default filled in."
        ),
    )
    verbs = parser.add_subparsers(dest="config_command", metavar="VERB", required=True)
    show = verbs.add_parser(
        "show",
        parents=parents,
        help="print the resolved config as YAML (what config.yaml of a run would hold)",
        description=(
            "Print the resolved config as YAML: the file, then the overrides, validated, with "
            "every default filled in and every path absolute. A run writes the same to its "
            "config.yaml."
        ),
    )
    add_config_and_overrides(show, example="train.epochs=2")
    show.set_defaults(run=run_show)
    validate = verbs.add_parser(
        "validate",
        parents=parents,
        help="check a config without running it: exit 0 if valid, 2 with every problem",
        description=(
            "Check a config (file and overrides) against the schema, and that each name in "
            "it (model, data, loss, collate, optimizer, schedule, metrics, step_fn, "
            "callbacks) is a built-in or an import path that resolves, without building, "
            "importing or training anything. Exit 0 when it is valid; exit 2 listing every "
            "problem at once, each with its key and the fix."
        ),
    )
    add_config_and_overrides(validate, example="loader.batch_size=128")
    validate.set_defaults(run=run_validate)


def run_show(args: argparse.Namespace) -> int:
    """``stoker config show``: print the resolved config as YAML; returns the exit code."""
    import yaml

    from stoker.config import load_config

    config = load_config(args.config, args.overrides)
    sys.stdout.write(yaml.safe_dump(config.to_dict(), sort_keys=False))
    return 0


def run_validate(args: argparse.Namespace) -> int:
    """``stoker config validate``: exit 0 when valid; a ConfigError lists every problem."""
    from stoker.config import load_config
    from stoker.config_refs import reference_problems
    from stoker.errors import ConfigError

    config = load_config(args.config, args.overrides)  # a ConfigError lists every problem
    problems = reference_problems(config)
    if problems:
        count = f"{len(problems)} name{'s' * (len(problems) != 1)}"
        raise ConfigError(
            f"{args.config}: {count} that resolve to nothing:\n"
            + "\n".join(f"  - {problem}" for problem in problems),
            hint="fix each key above (the paths shown are resolved: a file's from the "
            "config's folder, an override's from the current folder)",
        )
    with_overrides = f" with {len(args.overrides)} override(s)" if args.overrides else ""
    print(f"{args.config}{with_overrides}: valid")
    return 0
