"""``stoker completion bash|zsh``: the shell completion script, made by shtab from the parser."""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh")
# Arguments completed as file or folder names, by their metavar.
_FILE_METAVARS = frozenset({"CONFIG", "FILE", "PATH", "INPUT", "SRC", "DST"})
_DIR_METAVARS = frozenset({"RUN_DIR", "DIR"})


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker completion`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "completion",
        parents=parents,
        help="print the shell completion script for bash or zsh",
        description=(
            "Print a completion script for stoker's commands, flags and file arguments. "
            "bash (with bash-completion): stoker completion bash > "
            "~/.local/share/bash-completion/completions/stoker (mkdir -p the folder first), "
            "or source <(stoker completion bash) in ~/.bashrc; zsh: stoker completion zsh > "
            "~/.zfunc/_stoker, with fpath=(~/.zfunc $fpath) before compinit in ~/.zshrc (any "
            "folder on $fpath). Open a new shell afterwards."
        ),
    )
    parser.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker completion``: print the completion script for the shell asked."""
    import shtab

    from stoker.cli.main import build_parser

    parser = build_parser()
    _complete_paths(parser, shtab)
    print(shtab.complete(parser, shell=args.shell))
    return 0


def _complete_paths(parser: argparse.ArgumentParser, shtab: object) -> None:
    """Mark the arguments that take a file or a folder, in this parser and every sub-parser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                _complete_paths(sub, shtab)
        elif action.metavar in _FILE_METAVARS:
            action.complete = shtab.FILE  # type: ignore[attr-defined]
        elif action.metavar in _DIR_METAVARS:
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]
