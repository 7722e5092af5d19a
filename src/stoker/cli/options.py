"""The subcommands' parser, and the arguments and flags they share."""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Sequence
from typing import Any


class CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: overrides anywhere after CONFIG, and its own usage in errors.

    argparse reads positionals in one run, so ``CONFIG --resume DIR train.epochs=4`` left
    ``train.epochs=4`` over; a parser made ``intermixed`` (by :func:`add_overrides`) reads
    the options first and then every positional in the order typed
    (``parse_intermixed_args``), wherever the options fall between them. And argparse
    hands a subcommand's unknown arguments up to ``stoker``'s own parser, whose error shows
    ``usage: stoker [-h] COMMAND``; here the subcommand reports them with its own usage.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.intermixed = False
        self._in_intermixed = False

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """Parse (intermixed when asked); an unknown argument is an error with this usage."""
        if self._in_intermixed or not self.intermixed:
            parsed, extras = super().parse_known_args(args, namespace)
        else:
            # parse_known_intermixed_args calls this method twice: plainly, for its passes.
            self._in_intermixed = True
            try:
                parsed, extras = self.parse_known_intermixed_args(args, namespace)
            finally:
                self._in_intermixed = False
        if extras and not self._in_intermixed:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def add_config_and_overrides(parser: argparse.ArgumentParser, *, example: str) -> None:
    """``CONFIG [KEY=VALUE ...]``; the overrides may come before, between or after options."""
    parser.add_argument("config", metavar="CONFIG", help="the run config (YAML)")
    overrides = parser.add_argument(
        "overrides",
        metavar="KEY=VALUE",
        nargs="*",
        help=f"config overrides, anywhere after CONFIG, e.g. {example}",
    )
    # Else a missing CONFIG reads "required: CONFIG, KEY=VALUE" when options are intermixed.
    overrides.required = False
    if isinstance(parser, CommandParser):
        parser.intermixed = True


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
    """The progress mode asked for: ``quiet`` when ``--quiet`` is given, else ``--progress``."""
    return "quiet" if args.quiet else args.progress


def run_dir_overrides(args: argparse.Namespace) -> list[str]:
    """``--run-dir`` as a config override, so the resolved config records it.

    The folder goes in as a quoted YAML string (JSON is YAML): a name such as ``a: b``
    or ``2024`` stays the folder's name instead of becoming a mapping or a number.
    """
    return [f"tracking.run_dir={json.dumps(args.run_dir)}"] if args.run_dir else []


def resume_template(command: Sequence[str], overrides: Sequence[str]) -> str:
    """The command that resumes a run, with ``{run_dir}`` where the run dir goes.

    ``command`` is what started the run without its overrides (``stoker train CONFIG``);
    the overrides follow ``--resume``, so the resumed run has the same config
    (``train.epochs=20`` included). Each word is shell-quoted, and braces are doubled so
    that ``str.format`` fills in only the run dir (``stoker.train.rundir.resume_command``).
    """
    tail = f" {_escape(shlex.join(overrides))}" if overrides else ""
    return f"{_escape(shlex.join(command))} --resume {{run_dir}}{tail}"


def _escape(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def add_weights_flags(parser: argparse.ArgumentParser) -> None:
    """``--which``, ``--device`` and ``--batch-size``: how a trained run is used."""
    parser.add_argument(
        "--which",
        choices=("best", "last"),
        default="best",
        help="the best checkpoint by train.monitor (default), or the last weights",
    )
    parser.add_argument(
        "--device", metavar="DEVICE", help="cpu, cuda, cuda:1, auto (default: the run's)"
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        metavar="N",
        help="samples per batch (default: the run's loader.val_batch_size or batch_size)",
    )
