"""The Python API page lists every public name, so the reference cannot drift from __all__."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import stoker

API_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "api.md"


def documented_names(page: str) -> set[str]:
    """The last dotted part of each ``::: module.Name`` line, and the names in ``members:``."""
    names = {m.group(1) for m in re.finditer(r"^::: [\w.]*?(\w+)\s*$", page, re.MULTILINE)}
    for members in re.findall(r"^\s*members: \[(.*)\]\s*$", page, re.MULTILINE):
        names.update(name.strip() for name in members.split(","))
    return names


@pytest.mark.parametrize("name", sorted(set(stoker.__all__) - {"__version__"}))
def test_every_public_name_is_in_the_api_reference(name: str) -> None:
    assert name in documented_names(API_PAGE.read_text(encoding="utf-8")), (
        f"stoker.{name} is in stoker.__all__ but not rendered in {API_PAGE}: "
        f"add a '::: <defining module>.{name}' line (or add it to a module's members list)"
    )


def test_a_name_mentioned_only_in_prose_does_not_count() -> None:
    page = "Use `fit` to train.\n\n::: stoker.train.session.train_run\n"
    assert documented_names(page) == {"train_run"}
