"""Sequence packing: documents joined by a separator and cut into full, fixed-length blocks.

What LLM pre-training does with variable-length text: instead of padding each document
to the longest in its batch, every document is followed by a separator (end-of-document)
token, the documents are concatenated into one token stream, and the stream is cut into
blocks of ``block_size`` tokens. Every position of every batch is a real token, so no
compute is spent on padding, and a block is an index into the stream: the dataset is
map-style, its length is fixed, and stoker's sampler state resumes it exactly.

A block ``i`` is a causal-LM pair: the inputs are ``stream[i*B : (i+1)*B]`` and the
targets the same tokens shifted by one, ``stream[i*B + 1 : (i+1)*B + 1]``. Over an epoch
every token of the stream but the first is a target exactly once, and only the tail
shorter than a block (fewer than ``block_size`` tokens, counted in ``dropped_tokens``)
is left out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from stoker.data.text import JsonlDataset
from stoker.data.tokenizers import ByteTokenizer
from stoker.errors import ConfigError, DataError

__all__ = [
    "PackedBlocks",
    "document_positions",
    "pack_documents",
    "packed_jsonl",
    "unigram_perplexity",
]


def _token_dtype(high: int) -> torch.dtype:
    """The smallest integer dtype that holds ids 0..high (a stream can be large)."""
    if high <= 255:
        return torch.uint8
    if high <= torch.iinfo(torch.int16).max:
        return torch.int16
    if high <= torch.iinfo(torch.int32).max:
        return torch.int32
    return torch.int64


def pack_documents(
    documents: Iterable[Sequence[int] | torch.Tensor], *, separator: int
) -> torch.Tensor:
    """Concatenate documents into one token stream, each followed by ``separator``.

    Args:
        documents: Token ids of each document (lists of ints or 1-D tensors).
        separator: The end-of-document id put after every document; pick one no
            document uses (for byte tokens, the padding id 0, which packing never needs).

    Returns:
        A 1-D tensor in the smallest integer dtype that holds every id.

    Raises:
        DataError: A document is not a flat sequence of non-negative integer ids.
    """
    parts: list[torch.Tensor] = []
    end = torch.tensor([separator], dtype=torch.long)
    for index, document in enumerate(documents):
        ids = torch.as_tensor(document)
        if ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
            raise DataError(
                f"document {index} is a tensor of shape {tuple(ids.shape)} and dtype "
                f"{ids.dtype}; expected a 1-D sequence of integer token ids.",
                hint="tokenize each document to a list of ints or a 1-D LongTensor",
            )
        parts += [ids.long(), end]
    if not parts:
        raise DataError("pack_documents got no documents.", hint="pass at least one document")
    stream = torch.cat(parts)
    if int(stream.min()) < 0:
        raise DataError(
            f"document token ids include {int(stream.min())}; expected ids >= 0.",
            hint="check the tokenizer and the separator id",
        )
    return stream.to(_token_dtype(int(stream.max())))


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(
            f"PackedBlocks {name}={value!r}; expected an int >= {minimum}.",
            hint=f"set {name} to an int >= {minimum} (e.g. block_size: 128)",
        )
    return value


class PackedBlocks(Dataset[Any]):
    """Fixed-length causal-LM blocks of a packed token stream; no padding anywhere.

    ``dataset[i]`` is ``(inputs, targets)``: ``block_size`` token ids and the same ids
    shifted by one. With ``position_ids``, inputs are a dict ``{"input_ids",
    "position_ids"}`` whose positions restart after every ``separator`` (and at the start
    of each block), so a model with learned positions sees each document from position
    0 — the cheap form of document-boundary resets: attention still crosses the
    separator (as in GPT-style pre-training), but needs no ``[T, T]`` mask, so a causal
    kernel (``is_causal=True``) still applies.

    It fetches whole batches (``__getitems__`` with ``returns_batches``): stoker's loader
    then makes each batch with one gather, with no per-sample collate.

    Example:
        >>> blocks = PackedBlocks.from_documents(
        ...     [tokenizer(t) for t in texts], block_size=128, separator=0)
        >>> inputs, targets = blocks[0]       # two LongTensors of 128 ids
    """

    returns_batches = True

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        block_size: int,
        position_ids: bool = False,
        separator: int | None = None,
    ) -> None:
        """Cut ``tokens`` into blocks.

        Args:
            tokens: The packed 1-D token stream (see :func:`pack_documents`).
            block_size: Tokens per block (the model's context length).
            position_ids: Give the inputs positions that restart after each separator.
            separator: The end-of-document id; needed for ``position_ids``.

        Raises:
            ConfigError: ``block_size`` is not a positive int, or ``position_ids``
                without a ``separator``.
            DataError: ``tokens`` is not 1-D integer, or holds less than one block.
        """
        self.block_size = _check_int("block_size", block_size, 1)
        if position_ids and separator is None:
            raise ConfigError(
                "PackedBlocks position_ids=True needs the separator id, to know where "
                "documents start.",
                hint="pass separator= the end-of-document id (e.g. separator=0)",
            )
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
            raise DataError(
                "PackedBlocks tokens must be a 1-D integer tensor (the packed stream).",
                hint="build the stream with stoker.data.pack_documents(documents, separator=...)",
            )
        self.blocks = (tokens.numel() - 1) // block_size
        if self.blocks < 1:
            raise DataError(
                f"PackedBlocks got {tokens.numel()} tokens; one block of {block_size} needs "
                f"{block_size + 1} (the targets run one token ahead).",
                hint=f"give more text, or a block_size below {max(tokens.numel() - 1, 1)}",
            )
        self.tokens = tokens
        self.separator = separator
        self.position_ids = position_ids
        used = self.blocks * block_size
        #: Tokens past the last full block (never a target this epoch).
        self.dropped_tokens = tokens.numel() - 1 - used
        # Row views of the stream, made once: a batch is one index_select per view.
        self._inputs = tokens[:used].view(self.blocks, block_size)
        self._targets = tokens[1 : used + 1].view(self.blocks, block_size)

    @classmethod
    def from_documents(
        cls,
        documents: Iterable[Sequence[int] | torch.Tensor],
        *,
        block_size: int,
        separator: int,
        position_ids: bool = False,
    ) -> PackedBlocks:
        """Pack ``documents`` (token ids each) with ``separator`` and cut the stream."""
        return cls(
            pack_documents(documents, separator=separator),
            block_size=block_size,
            position_ids=position_ids,
            separator=separator,
        )

    def __len__(self) -> int:
        return self.blocks

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor]:
        if not -self.blocks <= index < self.blocks:
            raise IndexError(f"block {index} of a PackedBlocks with {self.blocks} blocks")
        inputs = self._inputs[index].long()
        return self._with_positions(inputs), self._targets[index].long()

    def __getitems__(self, indices: Sequence[int]) -> tuple[Any, torch.Tensor]:
        """One batch of blocks: ``inputs`` [N, block_size] and ``targets`` [N, block_size]."""
        rows = torch.as_tensor(indices, dtype=torch.long)
        inputs = self._inputs.index_select(0, rows).long()
        return self._with_positions(inputs), self._targets.index_select(0, rows).long()

    def _with_positions(self, inputs: torch.Tensor) -> Any:
        if not self.position_ids:
            return inputs
        return {"input_ids": inputs, "position_ids": document_positions(inputs, self.separator)}  # type: ignore[arg-type]

    def targets(self) -> torch.Tensor:
        """Every target token of an epoch, in block order (a view; for baselines)."""
        return self._targets.reshape(-1)

    def lengths(self) -> torch.Tensor:
        """Tokens per sample: every block is full."""
        return torch.full((self.blocks,), self.block_size, dtype=torch.long)

    def __repr__(self) -> str:
        return (
            f"PackedBlocks({self.blocks} blocks of {self.block_size} tokens, "
            f"{self.dropped_tokens} tail tokens dropped, position_ids={self.position_ids})"
        )


def document_positions(inputs: torch.Tensor, separator: int) -> torch.Tensor:
    """Positions that restart at 0 after each ``separator`` and at each row's start.

    Only the row's own tokens are read (no state from earlier blocks), so a position is
    always below the block size and a model's position table of that size suffices.

    Args:
        inputs: Token ids, ``[..., T]``.
        separator: The end-of-document id.
    """
    steps = torch.arange(inputs.shape[-1], device=inputs.device).expand_as(inputs)
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[..., 1:] = inputs[..., :-1] == separator
    starts[..., 0] = True
    # The most recent document start at or before each position.
    begin = torch.where(starts, steps, torch.zeros_like(steps)).cummax(dim=-1).values
    return steps - begin


def unigram_perplexity(train: torch.Tensor, val: torch.Tensor, *, vocab_size: int) -> float:
    """The perplexity on ``val`` of token frequencies counted on ``train``: the baseline.

    A language model that ignores context entirely does this well; one that reads its
    context must do better. Counts are add-one smoothed so an unseen token is not
    infinitely surprising.

    Args:
        train: Training tokens (e.g. ``blocks.targets()``).
        val: Validation tokens the perplexity is measured on.
        vocab_size: Number of token ids.
    """
    counts = torch.bincount(train.long().reshape(-1), minlength=vocab_size).double() + 1.0
    log_p = (counts / counts.sum()).log()
    return math.exp(-log_p[val.long().reshape(-1)].mean().item())


def packed_jsonl(
    path: str,
    *,
    text_field: str = "text",
    block_size: int = 128,
    separator: int = 0,
    position_ids: bool = False,
) -> PackedBlocks:
    """A JSONL file of texts as packed byte-level blocks, for a config's ``data.train``.

    Each line's text becomes UTF-8 byte ids 1..256 (:class:`ByteTokenizer`), so the
    default separator 0 (the padding id, which packing never uses) is free: a model
    over these blocks has ``vocab_size: 257``. The whole file is tokenized once, into
    memory (one byte per token).

    Example:
        ``data: {train: {name: "stoker.data.packing:packed_jsonl",
        args: {path: corpus.jsonl, block_size: 128}}}``
    """
    texts = JsonlDataset(path, text_field=text_field, label_field=None, tokenizer=ByteTokenizer())
    return PackedBlocks.from_documents(
        (texts[i] for i in range(len(texts))),
        block_size=block_size,
        separator=separator,
        position_ids=position_ids,
    )
