"""Bad records end to end: sources skip them, the loader drops, logs and limits them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from stoker.data import ArrayDataset, build_loader
from stoker.data.loader import skip_bad_collate
from stoker.data.records import BadRecordError, BadRecordLog, BadSample, FilteredBatch
from stoker.data.text import JsonlDataset
from stoker.errors import DataError


def bad(i: int) -> BadSample:
    return BadSample(source="mem", location=f"index {i}", reason=f"sample {i} is broken")


class Flaky(Dataset):
    """Samples ``(tensor([i]), i)``; the indices in ``broken`` come back as BadSample."""

    def __init__(self, n: int, broken: set[int]) -> None:
        self.n, self.broken = n, broken

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return bad(i) if i in self.broken else (torch.tensor([float(i)]), i)


class FlakyBatches(ArrayDataset):
    """A batched source that reports the indices in ``broken`` as FilteredBatch."""

    def __init__(self, n: int, broken: set[int]) -> None:
        super().__init__(torch.arange(n, dtype=torch.float32)[:, None], torch.arange(n))
        self.broken = broken

    def __getitems__(self, indices):
        indices = torch.as_tensor(indices).tolist()
        good = [i for i in indices if i not in self.broken]
        missing = [bad(i) for i in indices if i in self.broken]
        if not missing:
            return super().__getitems__(indices)
        return FilteredBatch(super().__getitems__(good) if good else None, missing)


def ids(loader) -> list[int]:
    return [int(i) for _, y in loader for i in y]


def test_skip_bad_collate_filters_and_reports() -> None:
    collate = skip_bad_collate()
    plain = collate([(torch.tensor([1.0]), 1), (torch.tensor([2.0]), 2)])
    assert not isinstance(plain, FilteredBatch) and plain[1].tolist() == [1, 2]
    mixed = collate([bad(0), (torch.tensor([1.0]), 1), bad(2)])
    assert isinstance(mixed, FilteredBatch) and mixed.batch[1].tolist() == [1]
    assert [b.location for b in mixed.bad] == ["index 0", "index 2"]
    assert mixed.runs == ((1, 1), (1, 0))
    empty = collate([bad(3)])
    assert empty.batch is None and empty.bad == [bad(3)]
    assert skip_bad_collate(collate) is collate
    assert skip_bad_collate(len)([bad(1), "ab", "c"]).batch == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_jsonl_skip_end_to_end(tmp_path: Path, num_workers: int) -> None:
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": f"t{i}", "label": i % 2}) for i in range(10)]
    lines[2] = "{broken"
    lines[7] = json.dumps({"text": "no label"})
    path.write_text("\n".join(lines) + "\n")
    loader = build_loader(
        JsonlDataset(path, bad_records="skip"), batch_size=4, num_workers=num_workers
    )
    loader.bad_records = BadRecordLog(tmp_path / "bad_records.jsonl")
    texts = [t for batch_texts, _ in loader for t in batch_texts]
    assert texts == [f"t{i}" for i in range(10) if i not in (2, 7)]
    assert loader.bad_records.total == 2
    logged = [
        json.loads(line) for line in (tmp_path / "bad_records.jsonl").read_text().splitlines()
    ]
    assert [r["location"] for r in logged] == ["line 3", "line 8"]
    assert all(r["source"] == str(path) for r in logged)
    assert "not valid JSON" in logged[0]["reason"] and "'label'" in logged[1]["reason"]


def test_policy_error_raises_naming_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "a", "label": 0}\n[1, 2]\n')
    loader = build_loader(JsonlDataset(path), batch_size=2)
    with pytest.raises(BadRecordError, match=r"data\.jsonl, line 2: expected a JSON object"):
        list(loader)


def test_all_bad_batches_are_dropped_and_counted() -> None:
    loader = build_loader(Flaky(12, broken={4, 5, 6, 7, 9}), batch_size=4)
    batches = list(loader)
    assert [b[1].tolist() for b in batches] == [[0, 1, 2, 3], [8, 10, 11]]
    assert all(isinstance(b, list) for b in batches)  # plain batches, no FilteredBatch
    assert loader.bad_records.total == 5 and loader.bad_records.consecutive == 0


def test_total_limit_raises() -> None:
    loader = build_loader(Flaky(20, broken={1, 5, 9, 13}), batch_size=4)
    loader.bad_records = BadRecordLog(max_total=3)
    with pytest.raises(
        DataError, match=r"4 bad records skipped, more than data\.max_bad_records=3"
    ):
        list(loader)


def test_consecutive_limit_counts_runs_across_batches() -> None:
    # 2 bad at the end of one batch and 2 at the start of the next: a run of 4.
    loader = build_loader(Flaky(12, broken={2, 3, 4, 5}), batch_size=4)
    loader.bad_records = BadRecordLog(max_consecutive=3)
    with pytest.raises(DataError, match="4 bad records in a row") as caught:
        list(loader)
    assert "index 5" in str(caught.value)
    # Bad records with good ones between them never form a run longer than 1.
    spread = build_loader(Flaky(12, broken={0, 2, 4, 6, 8, 10}), batch_size=4)
    spread.bad_records = BadRecordLog(max_consecutive=1)
    assert ids(spread) == [1, 3, 5, 7, 9, 11] and spread.bad_records.total == 6


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batched_source_filtered_batches(num_workers: int) -> None:
    loader = build_loader(
        FlakyBatches(12, broken={1, 4, 5, 6, 7}), batch_size=4, num_workers=num_workers
    )
    assert loader.returns_batches and (num_workers > 0 or loader._direct)
    batches = list(loader)
    assert [b[1].tolist() for b in batches] == [[0, 2, 3], [8, 9, 10, 11]]
    assert loader.bad_records.total == 5 and loader.bad_records.consecutive == 0


def test_batched_source_consecutive_limit() -> None:
    loader = build_loader(FlakyBatches(12, broken=set(range(3, 12))), batch_size=4)
    loader.bad_records = BadRecordLog(max_consecutive=5)
    with pytest.raises(DataError, match="bad records in a row"):
        list(loader)


@pytest.mark.cuda
@pytest.mark.parametrize("dataset", [Flaky(8, broken={1}), FlakyBatches(8, broken={1})])
def test_filtered_batches_are_pinned(dataset: Dataset) -> None:
    loader = build_loader(dataset, batch_size=4, pin_memory=True, device="cuda")
    batches = list(loader)
    assert [b[1].tolist() for b in batches] == [[0, 2, 3], [4, 5, 6, 7]]
    assert all(b[0].is_pinned() for b in batches)


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_bad_record_is_logged_once_per_run(
    tmp_path: Path, num_workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    loader = build_loader(
        Flaky(12, broken={3, 8}), batch_size=4, shuffle=True, num_workers=num_workers
    )
    loader.bad_records = BadRecordLog(tmp_path / "bad_records.jsonl")
    with caplog.at_level("WARNING", logger="stoker"):
        for _ in range(3):
            assert sorted(ids(loader)) == [i for i in range(12) if i not in (3, 8)]
    logged = lines(tmp_path / "bad_records.jsonl")
    assert sorted(r["location"] for r in logged) == ["index 3", "index 8"]
    assert {r["split"] for r in logged} == {"train"}
    assert loader.bad_records.total == 2
    said = [r.getMessage() for r in caplog.records if "bad record" in r.getMessage()]
    assert sorted(said) == [
        "skipped bad record (train): mem, index 3: sample 3 is broken",
        "skipped bad record (train): mem, index 8: sample 8 is broken",
    ]


def test_train_and_val_share_one_file_and_one_count(tmp_path: Path) -> None:
    train = BadRecordLog(tmp_path / "bad_records.jsonl", max_total=2)
    val = train.for_split("val")
    train.record_bad([bad(1)])
    val.record_bad([bad(5)])
    val.record_bad([bad(5), bad(1)])  # met again, by either split: not new
    assert train.total == val.total == 2
    assert [(r["location"], r["split"]) for r in lines(tmp_path / "bad_records.jsonl")] == [
        ("index 1", "train"),
        ("index 5", "val"),
    ]
    with pytest.raises(DataError, match="3 bad records skipped"):
        val.record_bad([bad(9)])  # the limit counts both splits


def test_a_resumed_run_writes_no_record_twice(tmp_path: Path) -> None:
    path = tmp_path / "bad_records.jsonl"
    log = BadRecordLog(path)
    log.record_bad([bad(1), bad(2)])
    state = log.state_dict()
    assert state == {"total": 2, "consecutive": 2, "seen": [["mem", "index 1"], ["mem", "index 2"]]}
    log.record_bad([bad(3)])  # written after the checkpoint; then killed mid-line
    with path.open("a") as stream:
        stream.write('{"source": "mem", "loc')
    resumed = BadRecordLog(path)
    resumed.load_state_dict(state)
    assert resumed.total == 3
    resumed.record_bad([bad(1), bad(3), bad(4)])
    assert [r["location"] for r in lines(path)] == ["index 1", "index 2", "index 3", "index 4"]
    # A checkpoint from before records were named in the state keeps its count.
    old = BadRecordLog(None)
    old.load_state_dict({"total": 5, "consecutive": 0})
    assert old.total == 5


def test_the_log_names_the_first_ten_then_says_the_rest_are_in_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = BadRecordLog(tmp_path / "bad_records.jsonl", max_consecutive=100)
    with caplog.at_level("WARNING", logger="stoker"):
        log.record_bad([bad(i) for i in range(12)])
        log.record_bad([bad(i) for i in range(14)])
    said = [r.getMessage() for r in caplog.records]
    assert said[:10] == [
        f"skipped bad record (train): mem, index {i}: sample {i} is broken" for i in range(10)
    ]
    assert said[10:] == [
        "more than 10 bad records skipped: the rest are not named here; see bad_records.jsonl"
    ]
    assert len(lines(tmp_path / "bad_records.jsonl")) == log.total == 14
