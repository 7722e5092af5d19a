"""Tests for stoker.data.text: the JSONL dataset, in-memory text and the tokenizers."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.data.records import BadRecordError, BadSample
from stoker.data.text import JsonlDataset, TextListDataset, _line_index
from stoker.data.tokenizers import ByteTokenizer, CharTokenizer
from stoker.errors import ConfigError, DataError


def write_jsonl(path: Path, records: list[object], *, newline: str = "\n") -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r, ensure_ascii=False) for r in records]
    path.write_text(newline.join(lines) + newline, encoding="utf-8")
    return path


RECORDS = [
    {"text": "héllo wörld", "label": "pos"},
    {"text": "日本語のテキスト", "label": "neg"},
    {"text": "plain", "label": "pos", "extra": 1},
    {"text": "🙂 emoji", "label": "mid"},
]


def test_jsonl_values_labels_and_classes(tmp_path: Path) -> None:
    ds = JsonlDataset(write_jsonl(tmp_path / "d.jsonl", RECORDS))
    assert len(ds) == 4
    assert ds.classes == ["mid", "neg", "pos"]
    texts = [ds[i][0] for i in range(4)]
    assert texts == [r["text"] for r in RECORDS]
    assert [int(ds[i][1]) for i in range(4)] == [2, 1, 2, 0]
    assert ds[1][1].dtype == torch.long and ds[1][1].shape == ()
    assert ds[-1][0] == "🙂 emoji"
    with pytest.raises(IndexError):
        ds[4]
    ds.close()


def test_jsonl_given_labels_and_tokenizer(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    ds = JsonlDataset(path, tokenizer=ByteTokenizer(), labels=["pos", "neg", "mid"])
    ids, label = ds[1]
    assert ids.dtype == torch.long and ids.shape == (len("日本語のテキスト".encode()),)
    assert ByteTokenizer().decode(ids) == "日本語のテキスト"
    assert int(label) == 1 and ds.classes == ["pos", "neg", "mid"]
    assert ds.lengths().tolist() == [len(r["text"].encode()) for r in RECORDS]


def test_jsonl_int_labels_and_unlabelled(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"t": "a", "y": 3}, {"t": "bc", "y": 0}])
    ds = JsonlDataset(path, text_field="t", label_field="y")
    assert ds.classes is None and [int(ds[i][1]) for i in range(2)] == [3, 0]
    bare = JsonlDataset(path, text_field="t", label_field=None, tokenizer=ByteTokenizer())
    assert bare[1].tolist() == [ord("b") + 1, ord("c") + 1]
    assert bare.lengths().tolist() == [1, 2]


def test_offsets_index_with_unicode_blank_lines_and_crlf(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    lines = ['{"text": "ä"}', "", '{"text": "日本"}', "", "", '{"text": "x"}']
    path.write_bytes("\r\n".join(lines).encode())  # CRLF, no final newline
    starts, numbers = _line_index(path)
    data = path.read_bytes()
    assert [data[s : s + 1] for s in starts] == [b"{"] * 3
    assert starts.tolist() == [0, data.index('{"text": "日本"}'.encode()), data.rindex(b"{")]
    assert numbers.tolist() == [1, 3, 6]
    ds = JsonlDataset(path, label_field=None)
    assert [ds[i] for i in range(3)] == ["ä", "日本", "x"]
    assert [ds.line_number(i) for i in range(3)] == [1, 3, 6]


def test_offsets_across_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("stoker.data.text._CHUNK_BYTES", 7)  # lines straddle chunks
    texts = ["ü" * (i % 5) + str(i) for i in range(40)]
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts] + [""] * 2)
    starts, numbers = _line_index(path)
    assert numbers is None or numbers.tolist() == list(range(1, 41))
    ds = JsonlDataset(path, label_field=None)
    assert len(ds) == 40 and [ds[i] for i in range(40)] == texts
    expected, offset = [], 0
    for line in path.read_bytes().splitlines(keepends=True)[:40]:
        expected.append(offset)
        offset += len(line)
    assert starts.tolist() == expected


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not valid JSON"),
        ('["a list"]', "expected a JSON object, got a JSON array"),
        ('{"label": "pos"}', "no 'text' field (fields: label)"),
        ('{"text": 5, "label": "pos"}', "field 'text' is a number, expected a string"),
        ('{"text": "x"}', "no 'label' label field"),
        ('{"text": "x", "label": "what"}', "unknown label 'what'"),
        ('{"text": "x", "label": 7}', "label 7 is out of range"),
        ('{"text": "x", "label": null}', "label None is a null"),
    ],
)
def test_jsonl_bad_record_names_file_and_line(tmp_path: Path, line: str, reason: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [RECORDS[0], RECORDS[1], "", line])
    ds = JsonlDataset(path, labels=["neg", "pos"])
    assert int(ds[0][1]) == 1
    with pytest.raises(BadRecordError) as caught:
        ds[2]
    assert caught.value.sample.location == "line 4"
    assert reason in caught.value.sample.reason
    assert str(path) in str(caught.value) and "line 4" in str(caught.value)
    skipping = JsonlDataset(path, labels=["neg", "pos"], bad_records="skip")
    bad = skipping[2]
    assert isinstance(bad, BadSample) and bad.source == str(path) and reason in bad.reason


def test_jsonl_discovery_ignores_bad_lines_and_lengths_zero(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", ["{oops", {"text": "abc", "label": "b"}])
    ds = JsonlDataset(path, bad_records="skip", tokenizer=CharTokenizer(["a", "b"]))
    assert ds.classes == ["b"] and ds.lengths().tolist() == [0, 3]
    assert ds[1][0].tolist() == [2, 3, 1]


def test_jsonl_is_picklable_and_reopens_its_file(tmp_path: Path) -> None:
    ds = JsonlDataset(write_jsonl(tmp_path / "d.jsonl", RECORDS))
    assert ds[0][0] == "héllo wörld"  # opens the handle and builds the index
    copy = pickle.loads(pickle.dumps(ds))
    assert copy._stream is None and copy[3][0] == "🙂 emoji" and copy.classes == ds.classes
    ds.close()
    copy.close()


def test_jsonl_option_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"missing\.jsonl"):
        JsonlDataset(tmp_path / "missing.jsonl")
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    with pytest.raises(ConfigError, match="bad_records='drop'"):
        JsonlDataset(path, bad_records="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="distinct"):
        JsonlDataset(path, labels=["a", "a"])


def test_byte_tokenizer_round_trip_and_truncation() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer("aé🙂")
    assert ids.dtype == torch.long and ids.tolist()[0] == ord("a") + 1
    assert ids.shape == (1 + 2 + 4,) and int(ids.min()) >= 1 and int(ids.max()) <= 256
    assert tokenizer.decode(ids) == "aé🙂" and tokenizer.vocab_size == 257
    assert tokenizer("").shape == (0,)
    assert ByteTokenizer(max_length=3)("abcdef").tolist() == [98, 99, 100]
    assert tokenizer.decode(torch.tensor([98, 99, 0, 0])) == "ab"  # padding dropped
    with pytest.raises(ConfigError, match="max_length=0"):
        ByteTokenizer(max_length=0)


def test_char_tokenizer_fit_round_trip_and_state() -> None:
    tokenizer = CharTokenizer.fit(["abca", "bcx"], min_count=2)
    assert tokenizer.vocab == ["a", "b", "c"] and tokenizer.vocab_size == 5
    assert tokenizer("abcx").tolist() == [2, 3, 4, 1]
    assert tokenizer.decode(tokenizer("cab")) == "cab"
    assert tokenizer.decode([2, 1, 0]) == "a\ufffd"
    restored = CharTokenizer.from_state_dict(json.loads(json.dumps(tokenizer.state_dict())))
    assert restored("abcx").tolist() == [2, 3, 4, 1]
    short = CharTokenizer.fit(["日本語"], max_length=2)
    assert short("日本語").tolist() == [2, 3] and short.vocab == sorted("日本語")
    with pytest.raises(ConfigError, match="min_count=0"):
        CharTokenizer.fit(["a"], min_count=0)


def test_text_list_dataset() -> None:
    tokenizer = ByteTokenizer()
    ds = TextListDataset(["ab", "c", "déf"], ["y", "x", "y"], tokenizer=tokenizer)
    assert ds.classes == ["x", "y"] and ds.targets.tolist() == [1, 0, 1]
    ids, label = ds[2]
    assert tokenizer.decode(ids) == "déf" and int(label) == 1
    assert ds.lengths().tolist() == [2, 1, 4]
    ints = TextListDataset(["a", "b"], np.array([3, 1]), tokenizer=tokenizer)
    assert ints.classes is None and ints.targets.tolist() == [3, 1]
    assert TextListDataset(["ab"], None, tokenizer=tokenizer)[0].tolist() == [98, 99]
    with pytest.raises(DataError, match="2 texts and 1 labels"):
        TextListDataset(["a", "b"], [0], tokenizer=tokenizer)
    with pytest.raises(DataError, match="class names"):
        TextListDataset(["a", "b"], [0, "x"], tokenizer=tokenizer)


# -- the text examples: the standard-library corpus and the classifier ----------------


@pytest.mark.parametrize("kind", ["cnn", "gru", "transformer"])
def test_text_classifier_ignores_how_much_padding_a_batch_has(kind: str) -> None:
    from stoker.data.collate import pad_collate
    from stoker.examples.models import TextClassifier

    model = TextClassifier(257, 3, embed_dim=16, hidden=16, kind=kind).eval()
    generator = torch.Generator().manual_seed(0)
    texts = [torch.randint(1, 257, (n,), generator=generator) for n in (5, 9, 12)]
    tight = pad_collate(texts)  # padded to 12
    loose = pad_collate(texts, pad_to_multiple_of=40)  # padded to 40
    assert tight["input_ids"].shape == (3, 12) and loose["input_ids"].shape == (3, 40)
    with torch.no_grad():
        assert torch.allclose(model(**tight), model(**loose), atol=1e-5)
        # Alone, each text gets the prediction it gets in the batch.
        alone = torch.cat([model(**pad_collate([t])) for t in texts])
        assert torch.allclose(alone, model(**tight), atol=1e-5)


def test_the_reverse_gru_reads_each_text_backwards_before_its_padding() -> None:
    from stoker.examples.models import _reverse_index

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    values = torch.arange(15.0).view(3, 5, 1)
    reversed_rows = values.gather(1, _reverse_index(mask, values)).squeeze(-1)
    assert reversed_rows.tolist() == [
        [2, 1, 0, 3, 4],
        [9, 8, 7, 6, 5],
        [10, 11, 12, 13, 14],
    ]


def test_stdlib_docstrings_are_parsed_once_per_process() -> None:
    from stoker.examples.text import _package_docstrings, stdlib_docstrings

    first = stdlib_docstrings()
    misses = _package_docstrings.cache_info().misses
    second = stdlib_docstrings()
    assert _package_docstrings.cache_info().misses == misses  # no file read again
    assert first == second and len(first[0]) > 1000
    assert max(len(t) for t in first[0]) == 400  # cut to max_chars
    whole, _ = stdlib_docstrings(max_chars=None)
    assert max(len(t) for t in whole) > 400


def test_stdlib_lm_blocks_split_documents_and_use_byte_ids_with_separator_0() -> None:
    from stoker.examples.text import stdlib_docstrings, stdlib_lm_blocks

    train = stdlib_lm_blocks(split="train", block_size=64)
    val = stdlib_lm_blocks(split="val", block_size=64)
    texts, _ = stdlib_docstrings(max_chars=None)
    documents = int((train.tokens == 0).sum()) + int((val.tokens == 0).sum())
    assert documents == len(texts)  # every document once, in one split or the other
    assert int((val.tokens == 0).sum()) == round(0.1 * len(texts))
    assert int(train.tokens.max()) <= 256 and train.block_size == 64
    assert train[0][0].shape == (64,)
    with pytest.raises(ConfigError, match="split"):
        stdlib_lm_blocks(split="test")
