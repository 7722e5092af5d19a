"""Tests for stoker.data.packing: packed token streams, fixed blocks, and the causal LM."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from stoker.data.loader import build_loader
from stoker.data.packing import (
    PackedBlocks,
    document_positions,
    pack_documents,
    packed_jsonl,
    unigram_perplexity,
)
from stoker.errors import ConfigError, DataError
from stoker.examples.models import CausalLM

SEP = 0


def documents(count: int = 40, *, seed: int = 0) -> list[torch.Tensor]:
    """Documents of 1..30 ids in 1..300 (so the stream needs int16)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 31, (count,), generator=generator)
    return [torch.randint(1, 301, (int(n),), generator=generator) for n in lengths]


def test_pack_documents_puts_a_separator_after_each_document() -> None:
    stream = pack_documents([[5, 6], [7], torch.tensor([8, 9, 10])], separator=SEP)
    assert stream.tolist() == [5, 6, 0, 7, 0, 8, 9, 10, 0]
    assert stream.dtype == torch.uint8  # the smallest dtype that holds every id
    assert pack_documents([[300]], separator=SEP).dtype == torch.int16


@pytest.mark.parametrize("bad", [[[1, 2], [[1, 2]]], [[1.5, 2.0]], []])
def test_pack_documents_refuses_what_is_not_token_ids(bad: list) -> None:
    with pytest.raises(DataError) as error:
        pack_documents(bad, separator=SEP)
    assert error.value.hint


def test_every_block_is_full_and_no_token_is_lost_or_duplicated() -> None:
    docs = documents()
    stream = pack_documents(docs, separator=SEP)
    blocks = PackedBlocks(stream, block_size=16)
    count = (stream.numel() - 1) // 16
    assert len(blocks) == count and blocks.dropped_tokens == stream.numel() - 1 - count * 16
    assert 0 <= blocks.dropped_tokens < 16
    inputs = torch.stack([blocks[i][0] for i in range(len(blocks))])
    targets = torch.stack([blocks[i][1] for i in range(len(blocks))])
    assert inputs.shape == targets.shape == (count, 16)
    assert inputs.dtype == targets.dtype == torch.long
    # In block order the inputs are the stream, and the targets the stream one ahead.
    assert torch.equal(inputs.reshape(-1), stream[: count * 16].long())
    assert torch.equal(targets.reshape(-1), stream[1 : count * 16 + 1].long())
    assert torch.equal(blocks.targets(), targets.reshape(-1).to(stream.dtype))
    # Each document's ids appear in the stream whole, in order, ended by the separator.
    assert stream.numel() == sum(len(d) + 1 for d in docs)
    assert int((stream == SEP).sum()) == len(docs)


def test_a_batch_fetch_equals_the_samples_stacked() -> None:
    blocks = PackedBlocks.from_documents(documents(), block_size=8, separator=SEP)
    inputs, targets = blocks.__getitems__([3, 0, 7])
    assert torch.equal(inputs, torch.stack([blocks[i][0] for i in (3, 0, 7)]))
    assert torch.equal(targets, torch.stack([blocks[i][1] for i in (3, 0, 7)]))
    with pytest.raises(IndexError):
        blocks[len(blocks)]


def loader(blocks: PackedBlocks, *, seed: int = 3):
    return build_loader(blocks, batch_size=4, shuffle=True, seed=seed)


def epoch_batches(epoch_loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(inputs.clone(), targets.clone()) for inputs, targets in epoch_loader]


def test_a_shuffled_epoch_serves_every_block_once_in_a_seeded_order() -> None:
    blocks = PackedBlocks.from_documents(documents(), block_size=8, separator=SEP)
    first = loader(blocks)
    assert first.returns_batches  # one gather per batch, no per-sample collate
    batches = epoch_batches(first)
    served = torch.cat([inputs for inputs, _ in batches])
    assert served.shape == (len(blocks), 8)
    every = torch.stack([blocks[i][0] for i in range(len(blocks))])
    # The same rows as the dataset's, each once (compared as sorted rows).
    assert sorted(map(tuple, served.tolist())) == sorted(map(tuple, every.tolist()))
    again = epoch_batches(loader(blocks))
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(batches, again, strict=True)
    )
    second_epoch = epoch_batches(first)  # the loader moved on to epoch 1: a new order
    assert not torch.equal(torch.cat([b[0] for b in second_epoch]), served)


def test_a_loader_resumed_mid_epoch_serves_exactly_the_rest() -> None:
    blocks = PackedBlocks.from_documents(documents(), block_size=8, separator=SEP)
    whole = epoch_batches(loader(blocks))
    interrupted = loader(blocks)
    iterator = iter(interrupted)
    for _ in range(3):
        next(iterator)
    state = interrupted.state_dict()
    assert state == {"epoch": 0, "batches_delivered": 3}
    resumed = loader(blocks)
    resumed.load_state_dict(state)
    rest = epoch_batches(resumed)
    assert len(rest) == len(whole) - 3
    assert all(
        torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        for a, b in zip(rest, whole[3:], strict=True)
    )


def test_document_positions_restart_after_each_separator_and_at_the_block_start() -> None:
    inputs = torch.tensor([[7, 7, 0, 5, 5, 5, 0, 0, 9], [4, 0, 1, 2, 3, 4, 5, 6, 7]])
    expected = [[0, 1, 2, 0, 1, 2, 3, 0, 0], [0, 1, 0, 1, 2, 3, 4, 5, 6]]
    assert document_positions(inputs, SEP).tolist() == expected
    blocks = PackedBlocks(inputs.reshape(-1), block_size=4, position_ids=True, separator=SEP)
    first, _ = blocks[0]
    assert first["input_ids"].tolist() == [7, 7, 0, 5]
    assert first["position_ids"].tolist() == [0, 1, 2, 0]
    batch, _ = blocks.__getitems__([0, 1])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 2, 0]]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"block_size": 0}, ConfigError),
        ({"block_size": True}, ConfigError),
        ({"block_size": 4, "position_ids": True}, ConfigError),  # no separator
        ({"block_size": 100}, DataError),  # fewer tokens than one block needs
    ],
)
def test_invalid_blocks_are_refused_with_a_fix(options: dict, error: type) -> None:
    with pytest.raises(error) as raised:
        PackedBlocks(torch.arange(1, 50), **options)
    assert raised.value.hint


def test_unigram_perplexity_matches_a_hand_computation() -> None:
    train = torch.tensor([1, 1, 1, 2])  # counts + 1 over a vocabulary of 3: [1, 4, 2] / 7
    val = torch.tensor([1, 2])
    expected = math.exp(-(math.log(4 / 7) + math.log(2 / 7)) / 2)
    assert unigram_perplexity(train, val, vocab_size=3) == pytest.approx(expected)


def test_packed_jsonl_packs_byte_tokens_of_each_text(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["ab", "c", "déf"]))
    blocks = packed_jsonl(str(path), block_size=3)
    # Byte ids are byte + 1; each text ends with separator 0; é is two bytes.
    stream = [98, 99, 0, 100, 0, 101, 196, 170, 103, 0]
    assert blocks.tokens.tolist() == stream
    assert len(blocks) == 3 and blocks.dropped_tokens == 0
    assert blocks[2][1].tolist() == stream[7:10]


def test_the_causal_lm_predicts_from_the_past_only() -> None:
    model = CausalLM(257, 16, dim=32, layers=2, heads=4).eval()
    tokens = torch.randint(1, 257, (2, 16), generator=torch.Generator().manual_seed(1))
    logits = model(tokens)
    assert logits.shape == (2, 257, 16)  # CrossEntropyLoss's [N, C, T] layout
    changed = tokens.clone()
    changed[:, 10:] = 5
    after = model(changed)
    # Positions before the change see the same past: the same predictions.
    assert torch.allclose(logits[..., :10], after[..., :10], atol=1e-5)
    assert not torch.allclose(logits[..., 10:], after[..., 10:])
    positions = document_positions(tokens, SEP)
    assert model(tokens, position_ids=positions).shape == (2, 257, 16)
    with pytest.raises(ValueError, match="block_size=16"):
        model(torch.ones(1, 17, dtype=torch.long))
