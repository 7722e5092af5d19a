"""Config validation errors as lines for people: the key or the override, what is wrong."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError


def describe_problems(
    exc: ValidationError, *, root: type[BaseModel], source: str, overrides: Sequence[str] = ()
) -> str:
    """Every problem of a failed validation, each with its field path, in one message.

    A problem with a value a ``key=value`` override set is named by that override
    (``train.epochs=abc: ...``), not by ``source``: the fix is on the command line, not
    in the file. A single such problem is one line.
    """
    keys = [(tuple(item.partition("=")[0].strip().split(".")), item) for item in overrides]
    problems = [_describe(error, root=root, overrides=keys) for error in exc.errors()]
    from_overrides = sum(by_override for _, by_override in problems)
    if len(problems) == 1 and from_overrides:
        return problems[0][0]
    if from_overrides == len(problems):
        who = "the overrides have"
    elif from_overrides:
        who = f"{source} and the overrides have"
    else:
        who = f"{source} has"
    count = f"{len(problems)} problem{'s' * (len(problems) != 1)}"
    return f"{who} {count}:\n" + "\n".join(f"  - {text}" for text, _ in problems)


def _describe(
    error: Mapping[str, Any],
    *,
    root: type[BaseModel],
    overrides: Sequence[tuple[tuple[str, ...], str]],
) -> tuple[str, bool]:
    """The problem as a line, and whether an override set the value it is about."""
    loc = tuple(error["loc"])
    path = ".".join(str(part) for part in loc) or "(top level)"
    # The last override that set this value, or a section holding it, is the one to blame.
    override = next(
        (item for keys, item in reversed(overrides) if tuple(map(str, loc[: len(keys)])) == keys),
        None,
    )
    if error["type"] == "extra_forbidden":
        parent = _section_at(root, loc[:-1])
        known = sorted(parent.model_fields) if parent is not None else []
        what = f"unknown key{suggest(str(loc[-1]), known)}; known keys here: {', '.join(known)}"
        return (f"{override}: {what}", True) if override else (f"{path}: {what}", False)
    message = error["msg"]
    if override is not None:
        inner = f" (at {path})" if override.partition("=")[0].strip() != path else ""
        return f"{override}: {message}{inner}", True
    given = error.get("input")
    if isinstance(given, (str, int, float, bool)) or given is None:
        return f"{path}: {message} (given: {given!r})", False
    return f"{path}: {message}", False


def _section_at(root: type[BaseModel], loc: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model a location points into, for listing its known keys."""
    model = root
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        nested = _model_in(field.annotation)
        if nested is None:
            return None
        model = nested
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def suggest(word: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
