"""Real text that ships with Python itself: docstrings of standard-library packages.

The task: read a docstring, name the package it documents (asyncio, email, importlib,
logging, tkinter or xml). It is real English written by many authors, offline on every
machine with CPython, and hard enough that a model must read the text: the majority
class (tkinter) is about a third of the samples. The same docstrings, whole and packed
into blocks, are the corpus of the small causal language model (``stdlib_lm_blocks``).
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from pathlib import Path

import torch

from stoker.data.packing import PackedBlocks
from stoker.data.tokenizers import ByteTokenizer
from stoker.errors import ConfigError

PACKAGES = ("asyncio", "email", "importlib", "logging", "tkinter", "xml")


def stdlib_docstrings(
    *, packages: tuple[str, ...] = PACKAGES, min_chars: int = 20, max_chars: int | None = 400
) -> tuple[list[str], list[int]]:
    """Docstrings of modules, classes and functions, labeled by their package.

    Source files are parsed with ``ast`` (nothing is imported), in sorted order, so
    the set is the same on every run of a given Python version. Test folders are left
    out. Texts are cut to ``max_chars`` (None keeps them whole).
    """
    texts: list[str] = []
    labels: list[int] = []
    for label, package in enumerate(packages):
        for doc in _package_docstrings(package):
            if len(doc) >= min_chars:
                texts.append(doc[:max_chars])
                labels.append(label)
    return texts, labels


@functools.cache
def _package_docstrings(package: str) -> tuple[str, ...]:
    """Every docstring of one package, parsed once per process.

    Parsing the six packages takes seconds, and a run reads them for its training and
    its validation split (and the LM for both as well): the second read is free.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    folder = root / package
    if not folder.is_dir():
        raise FileNotFoundError(f"standard-library package {package!r} not found in {root}")
    docs: list[str] = []
    for path in sorted(folder.rglob("*.py")):
        if any(part in ("test", "tests", "idle_test") for part in path.parts):
            continue
        docs += _docstrings(path)
    return tuple(docs)


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


def stdlib_lm_blocks(
    *,
    split: str = "train",
    block_size: int = 64,
    val_fraction: float = 0.1,
    position_ids: bool = False,
    max_documents: int | None = None,
    seed: int = 0,
) -> PackedBlocks:
    """The standard-library docstrings as a packed byte-level corpus for a causal LM.

    Whole docstrings are the documents, tokenized to UTF-8 byte ids 1..256 and each
    followed by the end-of-document id 0 (``ByteTokenizer``'s padding id, which packing
    never needs), so the vocabulary is 257. The split is by document, fixed by
    ``seed``: validation text is text the model never trained on.

    Args:
        split: ``train`` or ``val``.
        block_size: Tokens per block (the model's context length).
        val_fraction: Share of the documents held out for ``val``.
        position_ids: Positions that restart at each document (see ``PackedBlocks``).
        max_documents: Keep only the first this many documents of the split (after the
            shuffle), for quick runs; None keeps all.
        seed: Seed of the split.

    Raises:
        ConfigError: ``split`` is not train or val, or ``val_fraction`` not in (0, 1).
    """
    if split not in ("train", "val"):
        raise ConfigError(
            f"data.*.args.split: {split!r} is not one of train, val",
            hint="set split: train for data.train and split: val for data.val",
        )
    if not 0 < val_fraction < 1:
        raise ConfigError(
            f"data.*.args.val_fraction: {val_fraction!r}; expected a number in (0, 1)",
            hint="e.g. val_fraction: 0.1",
        )
    texts, _ = stdlib_docstrings(max_chars=None)
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed))
    cut = len(texts) - max(1, round(val_fraction * len(texts)))
    keep = order[:cut] if split == "train" else order[cut:]
    if max_documents is not None:
        keep = keep[:max_documents]
    tokenizer = ByteTokenizer()
    return PackedBlocks.from_documents(
        (tokenizer(texts[i]) for i in keep.tolist()),
        block_size=block_size,
        separator=ByteTokenizer.pad_id,
        position_ids=position_ids,
    )
