"""Tokenizers for small text models: UTF-8 bytes, or a character vocabulary fitted on data."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch

from stoker.errors import ConfigError

__all__ = ["ByteTokenizer", "CharTokenizer", "Tokenizer", "as_ids"]


class Tokenizer(Protocol):
    """Anything that turns a text into token ids: ``tokenizer(text) -> LongTensor[L]``."""

    def __call__(self, text: str) -> torch.Tensor:
        """The token ids of ``text``, a 1-D long tensor (0 is padding)."""


def _check_max_length(max_length: int | None, owner: str) -> int | None:
    if max_length is None:
        return None
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise ConfigError(
            f"{owner} max_length={max_length!r}; expected None or an int >= 1.",
            hint=f"e.g. {owner}(max_length=512), or max_length=None for no truncation",
        )
    return max_length


def as_ids(tokens: Any) -> torch.Tensor:
    """A tokenizer's output (a tensor or a list of ints) as a 1-D LongTensor."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    return ids.reshape(-1)


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 1, so 0 is free for padding (257 ids in all)."""

    vocab_size = 257
    pad_id = 0

    def __init__(self, max_length: int | None = None) -> None:
        """Build the tokenizer.

        Args:
            max_length: Keep at most this many tokens (bytes) of each text; None keeps all.
        """
        self.max_length = _check_max_length(max_length, "ByteTokenizer")

    def __call__(self, text: str) -> torch.Tensor:
        """The UTF-8 bytes of ``text`` plus one (0 stays padding), cut to ``max_length``."""
        data = text.encode("utf-8")[: self.max_length]
        if not data:
            return torch.zeros(0, dtype=torch.long)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long().add_(1)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of ``ids``; padding is dropped, a cut multi-byte character shows as �."""
        values = [int(i) - 1 for i in as_ids(ids).tolist() if i != self.pad_id]
        return bytes(values).decode("utf-8", errors="replace")

    def state_dict(self) -> dict[str, Any]:
        """What ``from_state_dict`` needs to make this tokenizer again (saved with a run)."""
        return {"max_length": self.max_length}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> ByteTokenizer:
        """The tokenizer a ``state_dict`` describes."""
        return cls(max_length=state["max_length"])

    def __repr__(self) -> str:
        return f"ByteTokenizer(max_length={self.max_length})"


class CharTokenizer:
    """Characters as tokens from a fitted vocabulary: 0 is padding, 1 an unknown character.

    Example:
        >>> tokenizer = CharTokenizer.fit(train_texts, min_count=2)
        >>> ids = tokenizer("hello")
    """

    pad_id = 0
    unk_id = 1

    def __init__(self, vocab: Sequence[str], *, max_length: int | None = None) -> None:
        """Build the tokenizer from a known vocabulary (see :meth:`fit`).

        Args:
            vocab: Distinct single characters; the character at position ``k`` gets id
                ``k + 2``.
            max_length: Keep at most this many tokens of each text; None keeps all.
        """
        self.vocab = list(vocab)
        bad = [c for c in self.vocab if not isinstance(c, str) or len(c) != 1]
        if bad or len(set(self.vocab)) != len(self.vocab):
            raise ConfigError(
                "CharTokenizer vocab must be distinct single characters; got "
                f"{bad[:5] or 'duplicates'}.",
                hint="build it with CharTokenizer.fit(texts)",
            )
        self.max_length = _check_max_length(max_length, "CharTokenizer")
        self._ids = {char: k + 2 for k, char in enumerate(self.vocab)}

    @classmethod
    def fit(
        cls, texts: Iterable[str], *, min_count: int = 1, max_length: int | None = None
    ) -> CharTokenizer:
        """Learn the vocabulary: every character seen at least ``min_count`` times, sorted.

        Args:
            texts: The training texts (read once; a generator is fine).
            min_count: Rarer characters map to the unknown id 1.
            max_length: Passed to the tokenizer.

        Returns:
            The fitted tokenizer.
        """
        if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
            raise ConfigError(
                f"CharTokenizer.fit min_count={min_count!r}; expected an int >= 1.",
                hint="e.g. CharTokenizer.fit(texts, min_count=2)",
            )
        counts: Counter[str] = Counter()
        for text in texts:
            counts.update(text)
        vocab = sorted(char for char, count in counts.items() if count >= min_count)
        return cls(vocab, max_length=max_length)

    @property
    def vocab_size(self) -> int:
        """Number of ids, padding and unknown included."""
        return len(self.vocab) + 2

    def __call__(self, text: str) -> torch.Tensor:
        """An id per character of ``text`` (1: not in the vocabulary), cut to ``max_length``."""
        # One character is one token, so cutting the text is cutting the tokens.
        ids = self._ids
        return torch.tensor([ids.get(c, 1) for c in text[: self.max_length]], dtype=torch.long)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """The text of ``ids``; padding is dropped, unknown characters show as �."""
        vocab = self.vocab
        return "".join(vocab[i - 2] if i >= 2 else "\ufffd" for i in as_ids(ids).tolist() if i != 0)

    def state_dict(self) -> dict[str, Any]:
        """The vocabulary and options, JSON-serializable."""
        return {"vocab": list(self.vocab), "max_length": self.max_length}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> CharTokenizer:
        """Rebuild a tokenizer saved with :meth:`state_dict`."""
        return cls(state["vocab"], max_length=state.get("max_length"))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size}, max_length={self.max_length})"
