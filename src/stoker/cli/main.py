"""The ``stoker`` command: parse, dispatch to a subcommand, turn errors into messages.

Answering fast: the subcommand modules import only argparse at load time and import the
training stack (torch, about two seconds) inside their ``run``, so ``stoker --help``,
``--version``, ``config`` and ``report`` start without it; ``tests/unit/test_cli_startup.py``
checks that torch stays out.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from stoker import __version__
from stoker.cli import (
    completion,
    data,
    demo,
    doctor,
    evaluate,
    explain,
    predict,
    report,
    train,
    tune,
)
from stoker.cli import config as config_command
from stoker.cli.options import CommandParser
from stoker.errors import StokerError

SUBCOMMANDS = (
    train,
    demo,
    evaluate,
    predict,
    doctor,
    tune,
    data,
    explain,
    report,
    config_command,
    completion,
)


def build_parser() -> argparse.ArgumentParser:
    """The full parser; the CLI reference is generated from it."""
    parser = argparse.ArgumentParser(
        prog="stoker",
        description="Train PyTorch models with a pipeline that measures itself.",
    )
    parser.add_argument("--version", action="version", version=f"stoker {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show the full traceback of an error")
    # Each subcommand's parser reports its own errors with its own usage.
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=CommandParser
    )
    for module in SUBCOMMANDS:
        module.add_parser(subparsers, parents=[common])
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="stoker: %(levelname)s: %(message)s",
        stream=sys.stderr,
    )
    # Libraries' own chatter stays out of the user's way unless debugging.
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("stoker").setLevel(logging.DEBUG if args.debug else logging.INFO)
    try:
        return args.run(args) or 0
    except StokerError as error:
        if args.debug:
            raise
        print(f"stoker: error: {_rank_prefix()}{error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("stoker: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # another pipe broke (a worker's, a peer's): that is an error to show
        # Whoever read stdout has gone (`stoker config show X | head -3`): stop quietly as
        # other tools do. Python's own flush of stdout at exit would fail again, with a
        # traceback, so stdout is pointed at devnull first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE: what a shell reports for a tool its pipe cut off


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (its write end polls as an error)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLERR)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no real stdout
        return False


def _rank_prefix() -> str:
    """``[rank N] `` in a process of a distributed run, so errors say where they arose."""
    world = os.environ.get("WORLD_SIZE", "1")
    return f"[rank {os.environ.get('RANK', '?')}] " if world not in ("", "1") else ""


if __name__ == "__main__":
    sys.exit(main())
