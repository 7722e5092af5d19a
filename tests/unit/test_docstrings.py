"""The public classes document what their constructor takes.

ruff's D1 rules (``make test``'s ``ruff check``) require a docstring on every public module,
class, function and method, but not on ``__init__`` (D107 is off): a class's docstring,
which the API reference shows with the signature, is where its arguments are described.
This checks that it names each of them.
"""

from __future__ import annotations

import inspect
from typing import Protocol

import stoker
import stoker.data


def _public_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for module in (stoker, stoker.data):
        for name in module.__all__:
            value = getattr(module, name)
            if inspect.isclass(value) and not issubclass(value, BaseException | Protocol):
                found.setdefault(name, value)
    return found


def test_every_public_constructor_argument_is_named_in_its_class_docstring() -> None:
    classes = _public_classes()
    assert {"ArrayDataset", "CsvDataset", "PadCollate", "EpochLoader"} <= set(classes)
    missing = {}
    for name, cls in classes.items():
        init = cls.__dict__.get("__init__")
        if init is None:  # inherited: documented where it is defined
            continue
        docs = (cls.__doc__ or "") + (init.__doc__ or "")
        params = [p for p in inspect.signature(init).parameters if p != "self"]
        if absent := [p for p in params if p not in docs]:
            missing[name] = absent
    assert not missing, f"constructor arguments no docstring names: {missing}"
