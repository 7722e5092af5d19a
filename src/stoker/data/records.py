"""Bad records: what a source returns for a malformed sample, and the policy that handles it.

A source never drops a record on its own. Under policy ``error`` (the default) it raises
:class:`BadRecordError` naming the file, the row or index and what was wrong. Under policy
``skip`` it returns a :class:`BadSample` in the record's place; the loader (in the main
process, so counts are exact with any number of workers) drops it from the batch and hands
it to :class:`BadRecordLog`, which writes it to ``bad_records.jsonl`` and stops the run
once the limits on total or consecutive skips are passed.

A record is logged and counted once per run: every epoch meets the same bad record
again (and the validation split once per evaluation), but it is one record to fix.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from stoker.errors import DataError
from stoker.safe_files import open_append, write_text

BadRecordPolicy = Literal["error", "skip"]

logger = logging.getLogger("stoker")

#: Bad records named one by one in the log; the rest are in bad_records.jsonl only.
LOGGED_ONE_BY_ONE = 10


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
        """One line for logs and errors: where the record is and what is wrong with it."""
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


@dataclass
class _Seen:
    """The distinct bad records of a run, shared by its training and validation logs."""

    keys: set[tuple[str, str]] = field(default_factory=set)
    #: Records counted by a checkpoint from before records were named in the state.
    unnamed: int = 0


def _key(sample: BadSample) -> tuple[str, str]:
    # The record is its place in the data; the reason may be worded differently each time.
    return (sample.source, sample.location)


class BadRecordLog:
    """Counts skipped records, writes each with its reason, enforces the limits.

    Each distinct record (its source and location) is written, logged and counted
    once per run, however many epochs meet it and whichever split it is in; the
    consecutive count follows the stream, so it counts every meeting. Records already
    in ``path`` (a run resumed, or restarted before its first checkpoint, in its run
    dir) count as met.

    Args:
        path: ``bad_records.jsonl`` in the run dir (None: count only).
        max_total: Stop the run after more than this many distinct bad records.
        max_consecutive: Stop after more than this many skips in a row (a broken shard).
        split: The split whose records this log receives (``train`` or ``val``),
            written with each record.
    """

    def __init__(
        self,
        path: Path | None = None,
        *,
        max_total: int = 1000,
        max_consecutive: int = 100,
        split: str = "train",
    ) -> None:
        self.path = path
        self.max_total = max_total
        self.max_consecutive = max_consecutive
        self.split = split
        self.consecutive = 0
        # A run resumed or restarted in its run dir: what the file holds is known already.
        self._seen = _Seen(keys=self._recorded())

    def for_split(self, split: str) -> BadRecordLog:
        """A log for another split's loader that writes to the same file and shares the count.

        A record met by either is logged once, and the limit on the total counts both.
        """
        view = BadRecordLog(
            None, max_total=self.max_total, max_consecutive=self.max_consecutive, split=split
        )
        view.path, view._seen = self.path, self._seen
        return view

    @property
    def total(self) -> int:
        """Distinct bad records skipped in this run, over every split."""
        return len(self._seen.keys) + self._seen.unnamed

    def record_good(self, count: int = 1) -> None:
        """Good records arrived: a run of bad ones has ended."""
        if count:
            self.consecutive = 0

    def record_bad(self, samples: list[BadSample]) -> None:
        """Log skipped records not met before; raise DataError once a limit is passed."""
        if not samples:
            return
        self.consecutive += len(samples)
        new = []
        for sample in samples:
            key = _key(sample)
            if key not in self._seen.keys:
                self._seen.keys.add(key)
                new.append(sample)
        if new:
            self._write(new)
            self._tell(new)
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

    def _write(self, samples: list[BadSample]) -> None:
        if self.path is None:
            return
        with open_append(self.path) as stream:
            for sample in samples:
                stream.write(json.dumps(asdict(sample) | {"split": self.split}) + "\n")

    def _tell(self, samples: list[BadSample]) -> None:
        """Name the first few bad records of the run in the log, each once."""
        first = self.total - len(samples) + 1  # the run's number of samples[0]
        where = "bad_records.jsonl" if self.path is not None else "the count"
        for number, sample in enumerate(samples, start=first):
            if number <= LOGGED_ONE_BY_ONE:
                logger.warning("skipped bad record (%s): %s", self.split, sample.describe())
            elif number == LOGGED_ONE_BY_ONE + 1:
                logger.warning(
                    "more than %d bad records skipped: the rest are not named here; see %s",
                    LOGGED_ONE_BY_ONE,
                    where,
                )

    def state_dict(self) -> dict[str, Any]:
        """The counts and the records met, so a resumed run logs none of them again."""
        return {
            "total": self.total,
            "consecutive": self.consecutive,
            "seen": sorted([source, location] for source, location in self._seen.keys),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`, adding to the records ``path`` holds.

        A run killed after it wrote a record but before its checkpoint meets that record
        again after the resume: read from the file, it is known, so not written twice.
        """
        keys = {(str(source), str(location)) for source, location in state.get("seen", [])}
        keys |= self._seen.keys
        self._seen.keys = keys
        # A checkpoint from before records were named in the state: keep its count.
        self._seen.unnamed = max(0, int(state["total"]) - len(keys))
        self.consecutive = int(state["consecutive"])

    def _recorded(self) -> set[tuple[str, str]]:
        """The records in ``path``; a line torn by a kill is dropped from the file."""
        if self.path is None or not self.path.exists():
            return set()
        text = self.path.read_text()
        kept: list[str] = []
        keys: set[tuple[str, str]] = set()
        for line in text.splitlines():
            try:
                entry = json.loads(line)
                key = (str(entry["source"]), str(entry["location"]))
            except (ValueError, KeyError, TypeError):
                continue  # cut short by the kill: the record will be met and written again
            if key not in keys:
                keys.add(key)
                kept.append(line)
        clean = "".join(line + "\n" for line in kept)
        if clean != text:
            write_text(self.path, clean)
        return keys


@dataclass(frozen=True)
class FilteredBatch:
    """A batch with its skipped records, as a batched source or the skip collate returns it.

    The loader unwraps it in the main process: ``bad`` goes to the BadRecordLog and
    ``batch`` (None when every record was bad) goes on to training.
    """

    batch: object | None
    bad: list[BadSample]


def first_sample(batch: tuple[Any, ...] | FilteredBatch) -> tuple[Any, ...] | BadSample:
    """The one sample of a batched source's one-index batch: ``__getitem__`` for sources
    that read whole batches (Parquet, CSV), with a bad record's stand-in under ``skip``."""
    if isinstance(batch, FilteredBatch):
        return batch.bad[0]
    return tuple(field[0] for field in batch)
