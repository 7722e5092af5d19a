"""Real text that ships with Python itself: docstrings of standard-library packages.

The task: read a docstring, name the package it documents (asyncio, email, importlib,
logging, tkinter or xml). It is real English written by many authors, offline on every
machine with CPython, and hard enough that a model must read the text: the majority
class (tkinter) is about a third of the samples.
"""

from __future__ import annotations

import ast
import sysconfig
from pathlib import Path

import torch

PACKAGES = ("asyncio", "email", "importlib", "logging", "tkinter", "xml")


def stdlib_docstrings(
    *, packages: tuple[str, ...] = PACKAGES, min_chars: int = 20, max_chars: int = 400
) -> tuple[list[str], list[int]]:
    """Docstrings of modules, classes and functions, labeled by their package.

    Source files are parsed with ``ast`` (nothing is imported), in sorted order, so
    the set is the same on every run of a given Python version. Test folders are left
    out. Texts are cut to ``max_chars``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    labels: list[int] = []
    for label, package in enumerate(packages):
        folder = root / package
        if not folder.is_dir():
            raise FileNotFoundError(f"standard-library package {package!r} not found in {root}")
        for path in sorted(folder.rglob("*.py")):
            if any(part in ("test", "tests", "idle_test") for part in path.parts):
                continue
            for doc in _docstrings(path):
                if len(doc) >= min_chars:
                    texts.append(doc[:max_chars])
                    labels.append(label)
    return texts, labels


def _docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError):
        return []
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [
        doc
        for node in ast.walk(tree)
        if isinstance(node, nodes) and (doc := ast.get_docstring(node))
    ]


def majority_baseline(labels: list[int] | torch.Tensor) -> float:
    """Accuracy of always answering the most common class."""
    counts = torch.bincount(torch.as_tensor(labels))
    return counts.max().item() / counts.sum().item()
