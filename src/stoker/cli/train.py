"""``stoker train CONFIG [key=value ...]``: train from a YAML run config."""

from __future__ import annotations

import argparse
import faulthandler
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stoker.cli.options import (
    add_config_and_overrides,
    add_run_flags,
    progress_mode,
    resume_template,
    run_dir_overrides,
)
from stoker.errors import ConfigError

if TYPE_CHECKING:
    from stoker.config import RunConfig


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker train`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "train",
        parents=parents,
        help="train from a YAML run config",
        description=(
            "Train from a YAML run config. Any key can be overridden as key.sub=value, "
            "anywhere after CONFIG. `--resume RUN_DIR train.epochs=N` extends a run to N "
            "epochs. Relative paths in the config resolve from its folder; those in "
            "overrides and flags from the current folder."
        ),
    )
    add_config_and_overrides(parser, example="train.epochs=2 loader.batch_size=128")
    add_run_flags(parser)
    parser.add_argument(
        "--nproc",
        type=int,
        metavar="N",
        help="train on N processes of this machine (DDP through torchrun; gloo on CPU, "
        "NCCL on GPUs); loader.batch_size is per process",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --nproc: when a rank fails, restart the group up to K times, resuming "
        "from the last checkpoint",
    )
    parser.add_argument(
        "--trust-run-code",
        action="store_true",
        help="with --resume: import the Python files (models.py:Net, a collate function...) "
        "that the config names inside RUN_DIR itself; without it such a resume is refused, "
        "as a run dir is data that may come from anyone, and importing a file runs it",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """``stoker train``: train from the config; with ``--nproc``, under torchrun."""
    # Imported here, so that `stoker --help` does not import torch (see stoker.cli.main).
    from stoker.config import load_config

    # The config first: a mistake in it is reported at once, before torch is imported.
    config = load_config(args.config, [*args.overrides, *run_dir_overrides(args)])
    from stoker.distributed.launch import inside_torchrun  # imports torch

    if args.resume and not args.trust_run_code:
        _refuse_run_dir_code(config, Path(args.resume))
    if args.nproc is not None and not inside_torchrun():
        return _launch(args, config)
    from stoker.train.session import train_run  # not in the launcher, which trains nothing

    if inside_torchrun():
        stacks_on_fatal_signals()
    # Under torchrun the run resumes on as many processes as it has now.
    world = os.environ.get("WORLD_SIZE", "1")
    result = train_run(
        config,
        resume=args.resume,
        progress=progress_mode(args),
        resume_hint=_resume_template(args, nproc=int(world) if world not in ("", "1") else None),
        allow_data_change=args.allow_data_change,
        allow_config_change=args.allow_config_change,
    )
    return 0 if result.history else 1


def stacks_on_fatal_signals() -> None:
    """Have this process print every thread's Python stack if a fatal signal kills it.

    For a rank under torchrun: one that dies of SIGSEGV or SIGABRT in native code (gloo,
    a C extension) writes no Python error, and the launcher's summary can only name the
    signal. A handler already installed (pytest's, the user's) is left as it is.
    """
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def _launch(args: argparse.Namespace, config: RunConfig) -> int:
    """Start ``--nproc`` ranks that all write one run dir, made here so they agree on it."""
    from stoker.distributed.launch import launch_local
    from stoker.train.rundir import create_run_dir, resume_command

    worker = ["train", args.config, *args.overrides]
    if args.resume:
        run_dir = args.resume
        worker += ["--resume", args.resume]
    else:
        tracking = config.tracking
        run_dir = create_run_dir(tracking.run_dir, root=tracking.runs_root, name=config.name)
        worker += ["--run-dir", str(run_dir)]
    worker += [flag for flag, on in _passed_flags(args) if on]
    worker += ["--progress", args.progress] if not args.quiet else []
    resume = resume_command(_resume_template(args, nproc=args.nproc), run_dir)
    return launch_local(
        worker, nproc=args.nproc, max_restarts=args.max_restarts, resume_hint=resume
    )


def _resume_template(args: argparse.Namespace, *, nproc: int | None) -> str:
    command = ["stoker", "train", args.config, *(["--nproc", str(nproc)] if nproc else [])]
    return resume_template(command, args.overrides)


def _refuse_run_dir_code(config: RunConfig, run_dir: Path) -> None:
    """Refuse to import Python files that sit in the run dir being resumed.

    stoker already treats a run dir's checkpoints as untrusted (``weights_only`` loads);
    a config that names ``RUN_DIR/models.py:Net`` would run that file, so whoever could
    write into the run dir could run code as this user. A config written by stoker names
    the user's code where it was (absolute paths), never in the run dir, so a normal
    resume never meets this.
    """
    resolved = run_dir.resolve()
    # --resume may name a checkpoint (RUN/checkpoints/step-…): its run dir is above.
    root = next(
        (p.parent for p in (resolved, *resolved.parents) if p.name == "checkpoints"), resolved
    )
    found = sorted({path for path in _code_files(config.to_dict()) if root in path.parents})
    if found:
        names = ", ".join(str(path) for path in found)
        raise ConfigError(
            f"the config imports Python code from the run dir being resumed: {names}; "
            "importing a file runs it, and a run dir is data that anyone who could write "
            "into it may have changed",
            hint="check that code, then pass --trust-run-code; or resume with the config "
            "and the code from your project instead of the run dir's copies",
        )


def _code_files(value: Any) -> list[Path]:
    """Every ``file.py`` named as ``file.py:callable`` anywhere in a config."""
    if isinstance(value, dict):
        return [path for item in value.values() for path in _code_files(item)]
    if isinstance(value, list | tuple):
        return [path for item in value for path in _code_files(item)]
    if isinstance(value, str):
        module, sep, attr = value.rpartition(":")
        if sep and attr and module.endswith(".py"):
            return [Path(module).resolve()]
    return []


def _passed_flags(args: argparse.Namespace) -> list[tuple[str, bool]]:
    return [
        ("--allow-data-change", args.allow_data_change),
        ("--trust-run-code", args.trust_run_code),
        ("--allow-config-change", args.allow_config_change),
        ("--quiet", args.quiet),
        ("--debug", args.debug),
    ]
