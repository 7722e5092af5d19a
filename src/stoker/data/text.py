"""Text datasets: a JSONL file read by byte offset, and in-memory lists of texts."""

from __future__ import annotations

import json
import operator
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stoker.data.records import BadRecordPolicy, bad_record
from stoker.data.tokenizers import Tokenizer, as_ids
from stoker.errors import ConfigError, DataError

__all__ = ["JsonlDataset", "TextListDataset"]

_CHUNK_BYTES = 1 << 20
_NEWLINE, _RETURN = 10, 13
_JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}


def _json_type(value: Any) -> str:
    """What JSON calls the type of a parsed value, for messages."""
    kind = type(value)
    return "number" if kind in (int, float) else _JSON_TYPES.get(kind, kind.__name__)


def _check_policy(policy: str) -> BadRecordPolicy:
    if policy not in ("error", "skip"):
        raise ConfigError(
            f"bad_records={policy!r}; expected error or skip.",
            hint="set data.bad_records=error (stop) or skip (drop and log)",
        )
    return policy  # type: ignore[return-value]


def _line_index(path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """Byte offsets of the non-empty lines of ``path`` and their 1-based line numbers.

    Reads the file once in chunks; only the offsets are kept. Empty lines (also a lone
    ``\\r`` of a CRLF file) are not records. The line numbers are None when no line was
    skipped (line of record ``i`` is ``i + 1``).
    """
    starts: list[np.ndarray] = []
    numbers: list[np.ndarray] = []
    offset = line_start = 0
    line_no, last_byte, skipped = 1, _NEWLINE, False
    with path.open("rb") as stream:
        while chunk := stream.read(_CHUNK_BYTES):
            data = np.frombuffer(chunk, dtype=np.uint8)
            newlines = np.flatnonzero(data == _NEWLINE)
            if newlines.size:
                ends = newlines + offset
                begins = np.concatenate(([line_start], ends[:-1] + 1))
                # The byte before each newline, which may end the previous chunk.
                before = np.concatenate(([last_byte], data))[newlines]
                length = ends - begins
                keep = (length > 1) | ((length == 1) & (before != _RETURN))
                skipped = skipped or not bool(keep.all())
                starts.append(begins[keep])
                numbers.append(np.arange(line_no, line_no + newlines.size)[keep])
                line_start, line_no = int(ends[-1]) + 1, line_no + newlines.size
            last_byte = int(data[-1])
            offset += len(chunk)
    tail = offset - line_start
    if tail > 1 or (tail == 1 and last_byte != _RETURN):
        starts.append(np.array([line_start]))
        numbers.append(np.array([line_no]))
    elif tail:
        skipped = True
    start_array = np.concatenate(starts).astype(np.int64) if starts else np.zeros(0, np.int64)
    if not skipped:
        return start_array, None
    return start_array, np.concatenate(numbers).astype(np.int64)


class JsonlDataset(Dataset[Any]):
    """One JSON object per line, read by byte offset: the file never sits in memory.

    The first use scans the file once for line offsets (and, when string labels must be
    discovered, parses it once more for the class names). ``dataset[i]`` then seeks to
    line ``i`` and parses only it. Samples are ``(token ids, label)`` with a tokenizer,
    ``(text, label)`` without; with ``label_field=None`` the sample is the ids or text alone.

    Example:
        >>> ds = JsonlDataset("reviews.jsonl", tokenizer=ByteTokenizer(max_length=256))
        >>> ds.classes
        ['negative', 'positive']
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        text_field: str = "text",
        label_field: str | None = "label",
        tokenizer: Tokenizer | None = None,
        labels: Sequence[str] | None = None,
        bad_records: BadRecordPolicy = "error",
    ) -> None:
        """Open the dataset (nothing is read until first use).

        Args:
            path: The ``.jsonl`` file.
            text_field: Key of the text in each object.
            label_field: Key of the label: a class name (string) or a class id (int);
                None for unlabelled text.
            tokenizer: Turns each text into token ids; None returns the text.
            labels: The class names in id order. None discovers them: every string
                label in the file, sorted (one extra pass over the file).
            bad_records: ``error`` raises on a malformed line; ``skip`` hands it to the
                loader, which drops and logs it.

        Raises:
            DataError: ``path`` is not a file.
            ConfigError: ``bad_records`` is not error/skip, or ``labels`` repeats a name.
        """
        self.path = Path(path)
        if not self.path.is_file():
            raise DataError(
                f"JSONL file {str(self.path)!r} does not exist or is not a file.",
                hint="check the data path",
            )
        self.text_field = text_field
        self.label_field = label_field
        self.tokenizer = tokenizer
        self.bad_records = _check_policy(bad_records)
        self._classes: list[str] | None = None
        if labels is not None:
            self._set_classes(list(labels))
        self._starts: np.ndarray | None = None
        self._line_numbers: np.ndarray | None = None
        self._lengths: torch.Tensor | None = None
        self._stream: IO[bytes] | None = None
        self._stream_pid = -1

    def _set_classes(self, classes: list[str]) -> None:
        if len(set(classes)) != len(classes) or not all(isinstance(c, str) for c in classes):
            raise ConfigError(
                f"labels={classes!r}; expected distinct class names (strings).",
                hint="list each class name once, in id order",
            )
        self._classes = classes
        self._class_ids = {name: i for i, name in enumerate(classes)}

    # -- the index -------------------------------------------------------------------

    def _index(self) -> np.ndarray:
        if self._starts is None:
            self._starts, self._line_numbers = _line_index(self.path)
            if self._classes is None and self.label_field is not None:
                self._discover_classes()
        return self._starts

    def _discover_classes(self) -> None:
        names = set()
        for i in range(len(self._starts)):  # type: ignore[arg-type]
            try:
                label = self._record(i).get(self.label_field)  # type: ignore[arg-type]
            except ValueError:
                continue  # reported when the record is read
            if isinstance(label, str):
                names.add(label)
        # No string labels: the labels are class ids and there are no names.
        if names:
            self._set_classes(sorted(names))

    @property
    def classes(self) -> list[str] | None:
        """The class names in id order; None when the labels are ids (or absent)."""
        self._index()
        return None if self._classes is None else list(self._classes)

    def line_number(self, index: int) -> int:
        """The 1-based line of the file that holds sample ``index``."""
        self._index()
        if self._line_numbers is None:
            return index + 1
        return int(self._line_numbers[index])

    def __len__(self) -> int:
        return len(self._index())

    # -- reading ---------------------------------------------------------------------

    def _file(self) -> IO[bytes]:
        # One handle per process: a handle inherited through fork shares its offset.
        if self._stream is None or self._stream_pid != os.getpid():
            self._stream = self.path.open("rb")
            self._stream_pid = os.getpid()
            # Reads go on until the dataset is collected; close it then, without a warning.
            weakref.finalize(self, self._stream.close)
        return self._stream

    def close(self) -> None:
        """Close this process's file handle (reopened on the next read)."""
        if self._stream is not None and self._stream_pid == os.getpid():
            self._stream.close()
        self._stream = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_stream"], state["_stream_pid"] = None, -1
        return state

    def _record(self, i: int) -> dict[str, Any]:
        """The object on the line of sample ``i``; raises ValueError with the reason."""
        stream = self._file()
        stream.seek(int(self._starts[i]))  # type: ignore[index]
        try:
            record = json.loads(stream.readline())
        except ValueError as error:  # also UnicodeDecodeError
            raise ValueError(f"not valid JSON: {error}") from None
        if not isinstance(record, dict):
            raise ValueError(f"expected a JSON object, got a JSON {_json_type(record)}")
        return record

    def _text(self, record: dict[str, Any]) -> str:
        """The text of ``record``; raises ValueError with the reason when there is none."""
        if self.text_field not in record:
            fields = ", ".join(sorted(record)) or "none"
            raise ValueError(f"no {self.text_field!r} field (fields: {fields})")
        text = record[self.text_field]
        if not isinstance(text, str):
            raise ValueError(
                f"field {self.text_field!r} is a {_json_type(text)}, expected a string"
            )
        return text

    def _label(self, record: dict[str, Any]) -> int:
        """The class id of ``record``; raises ValueError with the reason when there is none."""
        field = self.label_field
        if field not in record:
            fields = ", ".join(sorted(record)) or "none"
            raise ValueError(f"no {field!r} label field (fields: {fields})")
        value = record[field]
        classes = self._classes
        if isinstance(value, str):
            if classes is None or value not in self._class_ids:
                known = "none (the other labels are class ids)" if classes is None else classes
                raise ValueError(f"unknown label {value!r}; known labels: {known}")
            return self._class_ids[value]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"label {value!r} is a {_json_type(value)}; expected a class name or id"
            )
        if value < 0 or (classes is not None and value >= len(classes)):
            limit = f" below {len(classes)}" if classes is not None else ""
            raise ValueError(f"label {value} is out of range; expected a class id >= 0{limit}")
        return value

    def __getitem__(self, index: int) -> Any:
        starts = self._index()
        i = operator.index(index)
        if not -len(starts) <= i < len(starts):
            raise IndexError(f"sample index {i} is out of range for {len(starts)} lines")
        i %= len(starts)
        try:
            record = self._record(i)
            text = self._text(record)
            label = None if self.label_field is None else self._label(record)
        except ValueError as error:
            return bad_record(
                self.bad_records,
                source=str(self.path),
                location=f"line {self.line_number(i)}",
                reason=str(error),
            )
        content = text if self.tokenizer is None else as_ids(self.tokenizer(text))
        if label is None:
            return content
        return content, torch.tensor(label, dtype=torch.long)

    def lengths(self) -> torch.Tensor:
        """Tokens (characters without a tokenizer) per sample; 0 for a malformed line.

        Computed in one pass over the file on the first call, then cached.
        """
        if self._lengths is None:
            sizes = np.zeros(len(self), dtype=np.int64)
            for i in range(len(sizes)):
                try:
                    text = self._text(self._record(i))
                except ValueError:
                    continue  # reported when the record is read
                tokens = text if self.tokenizer is None else as_ids(self.tokenizer(text))
                sizes[i] = len(tokens)
            self._lengths = torch.from_numpy(sizes)
        return self._lengths

    def __repr__(self) -> str:
        return f"JsonlDataset({str(self.path)!r}, text_field={self.text_field!r})"


class TextListDataset(Dataset[Any]):
    """In-memory texts and labels; samples are ``(token ids, label)``.

    String labels become class ids in sorted order (``classes``); int labels are used as
    they are. ``targets`` holds the ids, so ``weights="balanced"`` works.
    """

    def __init__(
        self,
        texts: Sequence[str],
        labels: Sequence[int] | Sequence[str] | torch.Tensor | np.ndarray | None,
        *,
        tokenizer: Tokenizer,
    ) -> None:
        """Build the dataset.

        Args:
            texts: One string per sample.
            labels: One label per sample (class names or ids); None for unlabelled text,
                whose samples are the token ids alone.
            tokenizer: Turns each text into token ids.

        Raises:
            DataError: A text is not a string, or the numbers of texts and labels differ.
        """
        self.texts = list(texts)
        bad = next((i for i, t in enumerate(self.texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise DataError(
                f"TextListDataset text {bad} is a {type(self.texts[bad]).__name__}; "
                "expected strings.",
                hint="pass a list of str",
            )
        self.tokenizer = tokenizer
        self.classes: list[str] | None = None
        self.targets: torch.Tensor | None = None
        if labels is not None:
            values = labels.tolist() if isinstance(labels, torch.Tensor | np.ndarray) else labels
            values = list(values)
            if len(values) != len(self.texts):
                raise DataError(
                    f"TextListDataset got {len(self.texts)} texts and {len(values)} labels; "
                    "expected one label per text.",
                    hint="pass labels of the same length as texts",
                )
            if values and all(isinstance(v, str) for v in values):
                self.classes = sorted(set(values))
                ids = {name: i for i, name in enumerate(self.classes)}
                values = [ids[v] for v in values]
            bad = next((v for v in values if isinstance(v, bool) or not isinstance(v, int)), None)
            if bad is not None:
                raise DataError(
                    f"TextListDataset label {bad!r} is a {type(bad).__name__}; expected all "
                    "labels to be class names (str) or all to be class ids (int).",
                    hint="map the labels to one kind first",
                )
            self.targets = torch.as_tensor(values, dtype=torch.long)
        self._lengths: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index: int) -> Any:
        ids = as_ids(self.tokenizer(self.texts[index]))
        if self.targets is None:
            return ids
        return ids, self.targets[index]

    def lengths(self) -> torch.Tensor:
        """Tokens per sample (computed once, then cached)."""
        if self._lengths is None:
            self._lengths = torch.tensor(
                [len(as_ids(self.tokenizer(t))) for t in self.texts], dtype=torch.long
            )
        return self._lengths

    def __repr__(self) -> str:
        return f"TextListDataset({len(self.texts)} texts, tokenizer={self.tokenizer!r})"
