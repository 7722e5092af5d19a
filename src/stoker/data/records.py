"""Bad records: what a source returns for a malformed sample, and the policy that handles it.

A source never drops a record on its own. Under policy ``error`` (the default) it raises
:class:`BadRecordError` naming the file, the row or index and what was wrong. Under policy
``skip`` it returns a :class:`BadSample` in the record's place; the loader (in the main
process, so counts are exact with any number of workers) drops it from the batch and hands
it to :class:`BadRecordLog`, which writes it to ``bad_records.jsonl`` and stops the run
once the limits on total or consecutive skips are passed.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from stoker.errors import DataError

BadRecordPolicy = Literal["error", "skip"]


@dataclass(frozen=True)
class BadSample:
    """Stands in for a record that could not be read, under policy ``skip``.

    Attributes:
        source: The file (or dataset) the record came from.
        location: Where in it: ``row 17``, ``line 3``, ``index 42``.
        reason: What was wrong, for a person.
    """

    source: str
    location: str
    reason: str

    def describe(self) -> str:
        return f"{self.source}, {self.location}: {self.reason}"


class BadRecordError(DataError):
    """A malformed record under policy ``error``."""

    def __init__(self, sample: BadSample) -> None:
        super().__init__(
            f"bad record in {sample.describe()}",
            hint="fix the record, or set data.bad_records=skip to skip and log such records",
        )
        self.sample = sample


def bad_record(policy: BadRecordPolicy, *, source: str, location: str, reason: str) -> BadSample:
    """Raise under ``error``; return the stand-in under ``skip``. Sources call this."""
    sample = BadSample(source=str(source), location=location, reason=reason)
    if policy == "error":
        raise BadRecordError(sample)
    return sample


class BadRecordLog:
    """Counts skipped records, writes each with its reason, enforces the limits.

    Args:
        path: ``bad_records.jsonl`` in the run dir (None: count only).
        max_total: Stop the run after more than this many skips in all.
        max_consecutive: Stop after more than this many skips in a row (a broken shard).
    """

    def __init__(
        self, path: Path | None = None, *, max_total: int = 1000, max_consecutive: int = 100
    ) -> None:
        self.path = path
        self.max_total = max_total
        self.max_consecutive = max_consecutive
        self.total = 0
        self.consecutive = 0

    def record_good(self, count: int = 1) -> None:
        """Good records arrived: a run of bad ones has ended."""
        if count:
            self.consecutive = 0

    def record_bad(self, samples: list[BadSample]) -> None:
        """Log skipped records; raise DataError once a limit is passed."""
        if not samples:
            return
        self.total += len(samples)
        self.consecutive += len(samples)
        if self.path is not None:
            with self.path.open("a") as stream:
                for sample in samples:
                    stream.write(json.dumps(asdict(sample)) + "\n")
        last = samples[-1].describe()
        if self.total > self.max_total:
            raise DataError(
                f"{self.total} bad records skipped, more than data.max_bad_records="
                f"{self.max_total}; the last: {last}",
                hint="fix the data (see bad_records.jsonl), or raise data.max_bad_records",
            )
        if self.consecutive > self.max_consecutive:
            raise DataError(
                f"{self.consecutive} bad records in a row, more than "
                f"data.max_consecutive_bad_records={self.max_consecutive}; the last: {last}",
                hint="a file is probably broken: check it (see bad_records.jsonl)",
            )

    def state_dict(self) -> dict[str, int]:
        return {"total": self.total, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.total, self.consecutive = state["total"], state["consecutive"]


@dataclass(frozen=True)
class FilteredBatch:
    """A batch with its skipped records, as a batched source or the skip collate returns it.

    The loader unwraps it in the main process: ``bad`` goes to the BadRecordLog and
    ``batch`` (None when every record was bad) goes on to training.
    """

    batch: object | None
    bad: list[BadSample]


def first_sample(batch: tuple | FilteredBatch) -> tuple | BadSample:
    """The one sample of a batched source's one-index batch: ``__getitem__`` for sources
    that read whole batches (Parquet, CSV), with a bad record's stand-in under ``skip``."""
    if isinstance(batch, FilteredBatch):
        return batch.bad[0]
    return tuple(field[0] for field in batch)
