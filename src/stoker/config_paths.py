"""Which run-config values are paths, and resolving them from where they were written.

One rule: a relative path resolves from the folder of what it was written in. A value in
a config file resolves from that file's folder, whatever the current folder is, so
``stoker train project/run.yaml`` finds ``project/data.csv`` and ``project/models.py``
from anywhere; a value typed on the command line (a ``KEY=VALUE`` override, ``--run-dir``)
resolves from the current folder, as every command-line path does. Resolved paths are
absolute, so messages show the file that was looked for, and the run dir's
``config.yaml`` trains the same data from any folder.

``stoker.fit`` has no config file: its options are used as given, and Python opens a
relative path from the current folder.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

#: Fields that name a callable, which may be ``file.py:callable``.
SPEC_FIELDS = frozenset(
    {
        ("model", "name"),
        ("data", "train", "name"),
        ("data", "val", "name"),
        ("data", "test", "name"),
        ("loss", "name"),
        ("train", "metrics"),
        ("callbacks", "item", "name"),
        ("loader", "collate_fn"),
        ("optim", "name"),
        ("schedule", "name"),
        ("train", "step_fn"),
        ("train", "eval_fn"),
    }
)
#: Fields that hold a file or folder.
PATH_FIELDS = frozenset(
    {("data", "cache_path"), ("tracking", "run_dir"), ("tracking", "runs_root")}
)
#: Keyword-argument mappings of components: an argument named like a path is one, and a
#: string ``file.py:callable`` anywhere else in them (a transform, say) is an import path.
ARG_FIELDS = frozenset(
    {
        ("model", "args"),
        ("data", "train", "args"),
        ("data", "val", "args"),
        ("data", "test", "args"),
        ("loss", "args"),
        ("callbacks", "item", "args"),
        ("loader", "collate_args"),
        ("optim", "args"),
        ("schedule", "args"),
    }
)
#: Argument names that hold paths (besides names ending in one of PATH_ARG_SUFFIXES).
PATH_ARG_NAMES = frozenset({"path", "paths", "root", "dir", "file", "folder"})
PATH_ARG_SUFFIXES = ("_path", "_paths", "_root", "_dir", "_file", "_folder")


def resolve_paths(value: Any, *, at: tuple[str, ...], base: Path) -> Any:
    """``value``, found at key path ``at`` of a raw config, with relative paths made absolute.

    Args:
        value: A raw (unvalidated) config value: the whole mapping (``at=()``), a section,
            or the value of one override.
        at: Where the value sits, e.g. ``("data", "train", "args", "path")``.
        base: The folder relative paths resolve from.

    Values of the wrong type are returned unchanged: validation reports them.
    """
    if at == ("callbacks",) and isinstance(value, list):
        # Each item an import path, or a {name, args} spec like a model's.
        return [
            resolve_spec(item, base=base)
            if isinstance(item, str)
            else resolve_paths(item, at=("callbacks", "item"), base=base)
            for item in value
        ]
    kind = _kind(at)
    if kind == "path":
        return _each_string(value, lambda text: resolve_path(text, base=base))
    if kind == "spec":
        return _each_string(value, lambda text: resolve_spec(text, base=base))
    if isinstance(value, Mapping):
        return {
            key: resolve_paths(item, at=(*at, str(key)), base=base) for key, item in value.items()
        }
    if kind == "arg":
        return _each_string(value, lambda text: resolve_spec(text, base=base))
    return value


def resolve_path(text: str, *, base: Path) -> str:
    """An absolute, normalized path; ``~`` is expanded and URLs (``s3://...``) are kept."""
    if "://" in text or not text:
        return text
    path = Path(text).expanduser()
    return os.path.normpath(path if path.is_absolute() else base / path)


def resolve_spec(text: str, *, base: Path) -> str:
    """``file.py:callable`` with an absolute file; any other import path unchanged."""
    module, sep, attr = text.partition(":")
    if not sep or not module.endswith(".py"):
        return text
    return f"{resolve_path(module, base=base)}:{attr}"


def _kind(at: tuple[str, ...]) -> str | None:
    if at in PATH_FIELDS:
        return "path"
    if at in SPEC_FIELDS:
        return "spec"
    for size in (2, 3):
        if len(at) > size and at[:size] in ARG_FIELDS:
            return "path" if is_path_arg(at[size]) else "arg"
    return None


def is_path_arg(name: str) -> bool:
    """Whether a component argument's name says it holds a path (``path``, ``cache_dir``)."""
    return name in PATH_ARG_NAMES or name.endswith(PATH_ARG_SUFFIXES)


def _each_string(value: Any, change: Callable[[str], str]) -> Any:
    """``change`` applied to a string, or to each string in a list or mapping of them."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, list):
        return [_each_string(item, change) for item in value]
    if isinstance(value, Mapping):
        return {key: _each_string(item, change) for key, item in value.items()}
    return value
