"""The generated references in docs/reference/ are current and cover the config and the CLI."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from stoker import reference
from stoker.cli.main import build_parser
from stoker.config import FLAT_OPTIONS, RunConfig

DOCS = Path(__file__).parents[2] / "docs"
REGENERATE = "stale: regenerate with `python -m stoker.reference`"


def _nested(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _nested(arg)]


def config_paths(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every key of the config tree as a dotted path, walked independently of the generator."""
    paths = []
    for name, field in model.model_fields.items():
        paths.append(prefix + name)
        for nested in _nested(field.annotation):
            paths.extend(config_paths(nested, f"{prefix}{name}."))
    return paths


def commands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *commands(sub)]
    return found


@pytest.mark.parametrize("name", ["config.md", "cli.md"])
def test_committed_reference_is_current(name: str) -> None:
    path = DOCS / "reference" / name
    assert path.is_file(), f"{path} is missing; {REGENERATE}"
    generated = reference.reference_files(DOCS)[path]
    assert path.read_text(encoding="utf-8") == generated, f"{path} is {REGENERATE}"


def test_config_reference_has_every_key_with_its_default() -> None:
    text = reference.config_reference()
    paths = config_paths()
    assert len(paths) > 60
    missing = [path for path in paths if f"`{path}`" not in text]
    assert not missing, f"keys missing from the config reference: {missing}"
    for section, field in RunConfig.model_fields.items():
        if _nested(field.annotation):  # each section has a heading of its own
            assert re.search(rf"^## (.*, )?{section}(,|$)", text, re.M), section
    # Every flat stoker.fit option is named beside its key.
    for option in FLAT_OPTIONS:
        assert f"| `{option}` |" in text, option
    assert "| `loader.batch_size` | int > 0 | `64` | `batch_size` |" in text
    assert "| `train.precision` | `fp32`, `bf16` or `fp16` | `fp32` | `precision` |" in text


def test_cli_reference_has_every_command_and_option() -> None:
    text = reference.cli_reference()
    parser = build_parser()
    subcommands = commands(parser)
    assert {sub.prog for sub in subcommands} >= {
        "stoker train",
        "stoker demo",
        "stoker data",
        "stoker data inspect",
        "stoker data convert",
        "stoker explain",
        "stoker report",
    }
    assert reference.command_names(parser) == [sub.prog for sub in subcommands]
    for sub in subcommands:
        assert re.search(rf"^#+ {re.escape(sub.prog)}$", text, re.M), sub.prog
        for action in sub._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert f"`{action.option_strings[0]}" in text, (sub.prog, action.option_strings)


def test_check_names_a_stale_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert reference.main(["--docs-dir", str(tmp_path)]) == 0
    assert reference.main(["--docs-dir", str(tmp_path), "--check"]) == 0
    stale = tmp_path / "reference" / "cli.md"
    stale.write_text(stale.read_text() + "edited by hand\n")
    capsys.readouterr()
    assert reference.main(["--docs-dir", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert str(stale) in err and "config.md" not in err


def test_module_check_passes_on_the_committed_docs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "stoker.reference", "--check", "--docs-dir", str(DOCS)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
