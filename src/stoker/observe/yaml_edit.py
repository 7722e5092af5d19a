"""Editing a run config's YAML in place: a round trip that keeps comments and style."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from stoker.config import LoaderConfig, load_yaml, validate_config
from stoker.errors import ConfigError

__all__ = ["write_loader_settings"]


def write_loader_settings(
    path: str | Path, settings: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """Set ``loader.<key>`` in the YAML file at ``path``; everything else stays as written.

    The file is edited as a round trip (ruamel.yaml): comments, key order, quoting and
    flow or block style are kept, and a new key is added in the style of its section.
    It is written only after the result validates as a run config.

    Returns:
        ``{key: (old, new)}`` for each key that changed (old is the default when absent).
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    path = Path(path)
    load_yaml(path)  # the errors for people: a missing file, bad YAML, not a mapping
    editor = YAML()  # round-trip mode
    editor.preserve_quotes = True
    editor.width = 4096  # never fold a long line the user wrote on one
    document = editor.load(path.read_text())
    loader = document.get("loader")
    if loader is None:
        loader = CommentedMap()
    if not isinstance(loader, dict):
        raise ConfigError(f"{path}: `loader` is a {type(loader).__name__}, not a section")
    defaults = LoaderConfig().model_dump()
    changes: dict[str, tuple[Any, Any]] = {}
    for key, value in settings.items():
        if key not in LoaderConfig.model_fields:
            raise ConfigError(f"loader.{key} is not a loader setting")
        old = loader.get(key, defaults.get(key))
        if old != value:
            loader[key] = value
            changes[key] = (old, value)
    if not changes:
        return changes
    document["loader"] = loader
    buffer = io.StringIO()
    editor.dump(document, buffer)
    text = buffer.getvalue()
    validate_config(yaml.safe_load(text), source=str(path))
    path.write_text(text)
    return changes
