"""Built-in datasets: real data shipped inside installed packages, and the seeds' sets."""

from __future__ import annotations

import numpy as np
import torch

from stoker.data.sources import ArrayDataset
from stoker.data.text import TextListDataset
from stoker.data.tokenizers import ByteTokenizer, CharTokenizer
from stoker.errors import ConfigError


def digits(*, normalize: bool = True) -> ArrayDataset:
    """The 1,797 8×8 handwritten digits that scikit-learn ships (no download).

    Samples are ``(pixels[64] float32, label int64)``; pixels are scaled to [0, 1]
    when ``normalize`` is set (they are 0–16 in the file).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError(
            "the built-in dataset 'digits' needs scikit-learn, which is not installed",
            hint="pip install 'stoker[demo]'",
        ) from None
    bunch = load_digits()
    pixels = bunch.data.astype(np.float32)
    if normalize:
        pixels /= 16.0
    return ArrayDataset(pixels, bunch.target.astype(np.int64), names=("pixels", "label"))


def seed_tabular(*, n_rows: int = 10_000, n_features: int = 20, seed: int = 42) -> ArrayDataset:
    """The seeds' synthetic workload: Gaussian rows, label = (x0 + x1 > 0).

    The same numbers as the seed module's ``CSVWindowDataset`` (NumPy generator 42).
    """
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(n_rows, n_features)).astype("float32")
    labels = (features[:, 0] + features[:, 1] > 0).astype("int64")
    return ArrayDataset(features, labels, names=("features", "label"))


def seed_regression(*, n_rows: int = 10_000, n_features: int = 10, seed: int = 0) -> ArrayDataset:
    """The seeds' regression set: Gaussian rows, target = sum of the features, shape [N, 1]."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(n_rows, n_features, generator=generator)
    return ArrayDataset(features, features.sum(dim=1, keepdim=True), names=("features", "target"))


DATASETS = {"digits": digits, "seed_tabular": seed_tabular, "seed_regression": seed_regression}


def stdlib_docstrings(
    *, tokenizer: str = "byte", max_length: int = 256, split: str = "all", seed: int = 0
) -> TextListDataset:
    """Standard-library docstrings labeled by package, tokenized (see ``stoker.examples.text``).

    Args:
        tokenizer: ``byte`` (UTF-8 bytes) or ``char`` (a character vocabulary).
        max_length: Tokens kept per text.
        split: ``all``, or ``train``/``val`` for a fixed 80/20 split by ``seed``.
        seed: Seed of that split.
    """
    from stoker.examples.text import stdlib_docstrings as load

    texts, labels = load()
    if split != "all":
        order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed))
        cut = int(0.8 * len(texts))
        keep = order[:cut] if split == "train" else order[cut:]
        texts = [texts[i] for i in keep.tolist()]
        labels = [labels[i] for i in keep.tolist()]
    if tokenizer == "byte":
        tok = ByteTokenizer(max_length=max_length)
    elif tokenizer == "char":
        tok = CharTokenizer.fit(texts, max_length=max_length)
    else:
        raise ConfigError(
            f"data.train.args.tokenizer: {tokenizer!r} is not one of byte, char",
            hint="set tokenizer: byte",
        )
    return TextListDataset(texts, labels, tokenizer=tok)


DATASETS["stdlib_docstrings"] = stdlib_docstrings
