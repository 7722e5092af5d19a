"""The names a run config gives — built-ins and import paths — checked without importing them.

``stoker config validate`` checks the schema (``stoker.config``), then this: that each
component name is a built-in or an import path that resolves. It imports neither torch
nor the user's code (a ``models.py`` may take seconds to import, or train on import): a
``file.py:name`` path is checked by reading the file (it exists, parses, and defines
``name`` at its top level), a ``package.module:name`` path by finding its top-level
package. What only running can tell — a factory's arguments, a module's submodules, a
name a module makes at import time — the run checks when it builds the component.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Iterator
from pathlib import Path

from stoker.config import RunConfig
from stoker.config_problems import suggest

#: The built-in names of each kind, as ``stoker.components`` resolves them (a test checks
#: that the two agree; the registries themselves import torch).
BUILTINS = {
    "model": ("causal_lm", "mlp", "text_classifier"),
    "data": (
        "csv",
        "digits",
        "image_folder",
        "jsonl",
        "npy",
        "parquet",
        "seed_regression",
        "seed_tabular",
        "shards",
        "stdlib_docstrings",
    ),
    "loss": ("bce_with_logits", "cross_entropy", "huber", "l1", "mse", "nll", "smooth_l1"),
    "collate": ("pad",),
}


def reference_problems(config: RunConfig) -> list[str]:
    """One line per name in ``config`` that is no built-in and no import path that resolves."""
    problems = []
    for key, name, kind in _names(config):
        problem = _check(name, kind)
        if problem:
            problems.append(f"{key}: {problem}")
    return problems


def _names(config: RunConfig) -> Iterator[tuple[str, str, str | None]]:
    """(config key, name, kind of built-in or None for import paths only)."""
    if config.model is not None:
        yield "model.name", config.model.name, "model"
    for split in ("train", "val", "test"):
        spec = getattr(config.data, split)
        if spec is not None:
            yield f"data.{split}.name", spec.name, "data"
    yield "loss.name", config.loss.name, "loss"
    if config.loader.collate_fn is not None:
        yield "loader.collate_fn", config.loader.collate_fn, "collate"
    # The schema checked the built-in optimizer, schedule and metric names.
    for key, name in (("optim.name", config.optim.name), ("schedule.name", config.schedule.name)):
        if ":" in name:
            yield key, name, None
    for index, metric in enumerate(config.train.metrics):
        name = metric if isinstance(metric, str) else metric.name
        if ":" in name:
            yield f"train.metrics[{index}]", name, None
    for key in ("step_fn", "eval_fn"):
        name = getattr(config.train, key)
        if name is not None:
            yield f"train.{key}", name, None
    for index, callback in enumerate(config.callbacks):
        name = callback if isinstance(callback, str) else callback.name
        yield f"callbacks[{index}]", name, None


def _check(name: str, kind: str | None) -> str | None:
    """What is wrong with ``name``, or None."""
    builtins = BUILTINS.get(kind or "", ())
    if name in builtins:
        return None
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        if builtins:
            return (
                f"{name!r} is neither a built-in name{suggest(name, builtins)} nor an import "
                f"path; built-ins: {', '.join(builtins)}, or `file.py:name`, "
                "`package.module:name`"
            )
        return f"{name!r} is no import path: give `file.py:name` or `package.module:name`"
    if module.endswith(".py"):
        return _check_file(Path(module), attr)
    top = module.split(".")[0]
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return f"no module {top!r} is installed (from {name!r})"
    return None


def _check_file(path: Path, attr: str) -> str | None:
    """Whether ``path`` exists, parses, and defines ``attr``'s first part at its top level."""
    if not path.is_file():
        return f"file {path} not found"
    try:
        tree = ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError) as error:
        return f"{path} does not parse: {error}"
    defined = _top_level_names(tree)
    if defined is None:  # a star import or a module __getattr__: only importing can tell
        return None
    first = attr.split(".")[0]
    if first not in defined:
        return f"{path} defines no {first!r}{suggest(first, defined)}"
    return None


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """The names a module's top level binds; None when it may bind names no one can read."""
    names: set[str] = set()
    for node in _top_level(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    if "__getattr__" in names:
        return None
    return names


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """The module's statements, with those under a top-level if/try/with (such as an
    ``if TYPE_CHECKING:`` or a ``try: import …`` fallback) included."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            blocks = [node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                blocks.append(handler.body)
            for block in reversed(blocks):
                stack.extend(reversed(block))
