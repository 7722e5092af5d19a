"""Editing a run config's YAML in place: a round trip that keeps comments and style."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from stoker.config import (
    DataConfig,
    LoaderConfig,
    OptimConfig,
    TrainConfig,
    load_yaml,
    validate_config,
)
from stoker.errors import ConfigError

__all__ = ["write_loader_settings", "write_settings"]

#: The sections ``write_settings`` edits, by their config model.
_SECTIONS = {"loader": LoaderConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig}


def write_loader_settings(
    path: str | Path, settings: Mapping[str, Any]
) -> dict[str, tuple[Any, Any]]:
    """:func:`write_settings` of ``loader.<key>`` for each key of ``settings``.

    Returns:
        ``{key: (old, new)}`` for each key that changed, without the ``loader.`` prefix.
    """
    changed = write_settings(path, {f"loader.{key}": value for key, value in settings.items()})
    return {key.split(".", 1)[1]: change for key, change in changed.items()}


def write_settings(path: str | Path, settings: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Set dotted ``section.key`` settings (``loader.num_workers``, ``data.cache``,
    ``optim.fused``, ``train.threads``) in the YAML file at ``path``; everything else
    stays as written.

    The file is edited as a round trip (ruamel.yaml): comments, key order, quoting and
    flow or block style are kept, and a new key is added in the style of its section
    (a missing section is added at the end). It is written only after the result
    validates as a run config.

    Returns:
        ``{dotted key: (old, new)}`` for each key that changed (old is the default when
        absent).
    """
    from ruamel.yaml import YAML
    from ruamel.yaml.comments import CommentedMap

    path = Path(path)
    load_yaml(path)  # the errors for people: a missing file, bad YAML, not a mapping
    editor = YAML()  # round-trip mode
    editor.preserve_quotes = True
    editor.width = 4096  # never fold a long line the user wrote on one
    document = editor.load(path.read_text())
    changes: dict[str, tuple[Any, Any]] = {}
    for dotted, value in settings.items():
        name, _, key = dotted.partition(".")
        model = _SECTIONS.get(name)
        if model is None:
            known = ", ".join(f"{n}.*" for n in _SECTIONS)
            raise ConfigError(f"{dotted} is not a setting stoker can write ({known})")
        if key not in model.model_fields:
            raise ConfigError(f"{dotted} is not a {name} setting")
        section = document.get(name)
        if section is None:
            section = CommentedMap()
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: `{name}` is a {type(section).__name__}, not a section")
        default = model.model_fields[key].get_default(call_default_factory=True)
        old = section.get(key, default)
        if old != value:
            section[key] = value
            document[name] = section
            changes[dotted] = (old, value)
    if not changes:
        return changes
    buffer = io.StringIO()
    editor.dump(document, buffer)
    text = buffer.getvalue()
    validate_config(yaml.safe_load(text), source=str(path))
    path.write_text(text)
    return changes
