"""Resume mid-epoch without reading again what was trained on (issue 18, item 6).

A loader resumed at batch k of an epoch must fetch only the samples after it, with 0 and
2 workers, and give the batches an uninterrupted pass gives, bit for bit: a user's
dataset that augments with torch's global RNG in its workers included.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

import stoker
from bitwise import assert_bitwise_equal
from stoker.components import build_datasets
from stoker.config import RunConfig
from stoker.data import build_loader
from stoker.data.memmap import NpyDataset
from stoker.data.parquet import ParquetDataset
from stoker.data.records import BadRecordError
from stoker.data.streaming import ShardStream
from stoker.data.tabular import CsvDataset
from stoker.errors import TrainingInterrupted

SAMPLES, FEATURES, BATCH, RESUME_AT, EPOCH = 96, 3, 8, 9, 1  # resume at batch 9 of 12


class Reads:
    """Rows fetched, counted across worker processes (one shared slot per process)."""

    def __init__(self) -> None:
        self.slots = torch.zeros(8, dtype=torch.int64).share_memory_()

    def add(self, rows: int) -> None:
        info = get_worker_info()
        self.slots[0 if info is None else info.id + 1] += rows

    def total(self) -> int:
        return int(self.slots.sum())


class Augmented(Dataset):
    """A user's map-style dataset: one sample a call, noise from torch's global RNG."""

    def __init__(self) -> None:
        self.x = torch.arange(SAMPLES * FEATURES, dtype=torch.float32).view(SAMPLES, FEATURES)
        self.reads = Reads()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        self.reads.add(1)
        return self.x[index] + torch.rand(FEATURES), torch.tensor(index % 3)


def _counted(cls: type) -> type:
    """``cls`` with its fetches counted (a batched source reads through ``__getitems__``)."""

    class Counted(cls):  # type: ignore[misc,valid-type]
        def __getitem__(self, index):
            self.reads.add(1)
            return super().__getitem__(index)

        def __getitems__(self, indices):
            self.reads.add(len(indices))
            return super().__getitems__(indices)

    Counted.__name__ = f"Counted{cls.__name__}"
    return Counted


def _table() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32), np.arange(SAMPLES) % 3


def _source(kind: str, folder: Path) -> Dataset:
    features, labels = _table()
    if kind == "map":
        return Augmented()
    if kind == "npy":
        np.save(folder / "x.npy", features)
        np.save(folder / "y.npy", labels)
        dataset = _counted(NpyDataset)(folder, mmap=False)
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({f"f{i}": features[:, i] for i in range(FEATURES)} | {"y": labels})
        pq.write_table(table, folder / "t.parquet", row_group_size=16)
        dataset = _counted(ParquetDataset)(folder / "t.parquet", target="y")
    else:
        rows = [",".join([*(f"f{i}" for i in range(FEATURES)), "y"])]
        rows += [
            ",".join([*(f"{v:.6f}" for v in x), str(y)])
            for x, y in zip(features, labels, strict=True)
        ]
        (folder / "t.csv").write_text("\n".join(rows) + "\n")
        dataset = _counted(CsvDataset)(folder / "t.csv", target="y")
    dataset.reads = Reads()
    return dataset


def _epoch(loader) -> tuple[list, torch.Tensor]:
    """The epoch's batches, and torch's global RNG state after batch RESUME_AT (what a
    checkpoint there holds: in-process fetches draw from it, as the model does)."""
    loader.set_epoch(EPOCH)
    batches, rng = [], None
    for batch in loader:
        batches.append(batch)
        if len(batches) == RESUME_AT:
            rng = torch.get_rng_state()
    return batches, rng


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "npy", "parquet", "csv"])
def test_resume_fetches_only_the_rest_and_equals_the_straight_pass(kind, workers, tmp_path):
    options = {"batch_size": BATCH, "shuffle": True, "seed": 3, "num_workers": workers}
    straight, rng = _epoch(build_loader(_source(kind, tmp_path), **options))
    assert len(straight) == SAMPLES // BATCH

    dataset = _source(kind, tmp_path)
    resumed = build_loader(dataset, **options)
    resumed.load_state_dict({"epoch": EPOCH, "batches_delivered": RESUME_AT})
    torch.manual_seed(1234)  # a new process: its RNG is whatever, until the resume sets it
    torch.set_rng_state(rng)
    rest = list(resumed)

    assert dataset.reads.total() == SAMPLES - RESUME_AT * BATCH  # not one sample read again
    assert_bitwise_equal(straight[RESUME_AT:], rest)
    assert resumed.epoch == EPOCH + 1  # the resumed pass ran to the epoch's end


def test_in_order_loader_resumes_without_reading_the_head(tmp_path) -> None:
    dataset = _source("npy", tmp_path)
    loader = build_loader(dataset, batch_size=BATCH, shuffle=False)
    loader.load_state_dict({"epoch": 0, "batches_delivered": 10})
    rest = list(loader)
    assert dataset.reads.total() == SAMPLES - 10 * BATCH
    assert torch.equal(rest[0][0], torch.from_numpy(_table()[0][80:88]))


def test_dropped_all_bad_batches_count_in_the_position(tmp_path) -> None:
    """A batch of bad records only is dropped: the source restarts after it, not before."""
    lines = [json.dumps({"x": i}) for i in range(12)]
    lines[4:8] = ["{broken"] * 4  # the second batch of 4, all bad
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")

    def stream():
        return ShardStream([tmp_path / "a.jsonl"], bad_records="skip")

    collate = lambda samples: [s["x"] for s in samples]  # noqa: E731
    loader = build_loader(stream(), batch_size=4, collate_fn=collate)
    batches = iter(loader)
    assert next(batches) == [0, 1, 2, 3]
    assert next(batches) == [8, 9, 10, 11]  # batch 2 of the source was all bad
    state = loader.state_dict(batches_consumed=2)
    assert state == {"epoch": 0, "batches_delivered": 2, "batches_read": 3}

    fresh = build_loader(stream(), batch_size=4, collate_fn=collate)
    fresh.load_state_dict(state)
    assert list(fresh) == []  # the source has nothing after its third batch
    assert fresh.bad_records.total == 0  # nor read the bad ones again


class CountingJsonl:
    """A shard reader that counts the records it reads, in every process."""

    def __init__(self) -> None:
        self.reads = Reads()

    def __call__(self, path: Path):
        for line in path.read_text().splitlines():
            self.reads.add(1)
            yield json.loads(line)


def _shard_files(folder: Path) -> tuple[list[Path], list[int]]:
    lengths = [7, 13, 3, 10, 5, 9]  # uneven: one worker's share ends before the other's
    paths, first = [], 0
    for shard, count in enumerate(lengths):
        path = folder / f"s{shard}.jsonl"
        path.write_text("".join(json.dumps({"x": first + i}) + "\n" for i in range(count)))
        paths.append(path)
        first += count
    return paths, lengths


@pytest.mark.parametrize("workers", [0, 2])
def test_shards_resume_skips_whole_shards_and_equals_the_straight_pass(workers, tmp_path):
    paths, lengths = _shard_files(tmp_path)

    def loader(reader):
        stream = ShardStream(paths, read_shard=reader, lengths=lengths, seed=1)
        collate = lambda samples: torch.tensor([s["x"] for s in samples])  # noqa: E731
        return build_loader(stream, batch_size=4, num_workers=workers, collate_fn=collate)

    straight = _epoch(loader(CountingJsonl()))[0]
    for at in (3, len(straight) - 2):  # early; and after one worker's share has ended
        reader = CountingJsonl()
        resumed = loader(reader)
        resumed.load_state_dict({"epoch": EPOCH, "batches_delivered": at})
        assert_bitwise_equal(straight[at:], list(resumed))
        rest = sum(len(batch) for batch in straight[at:])
        # Whole shards before the position are not opened; a shard is read from its start.
        assert reader.reads.total() < rest + max(lengths) * max(workers, 1)
        assert reader.reads.total() <= sum(lengths) - lengths[0]  # the first shard never


def test_shards_source_honours_data_bad_records(tmp_path) -> None:
    (tmp_path / "a.jsonl").write_text('{"x": 1}\n{not json\n{"x": 3}\n')
    base = {
        "model": {"name": "mlp"},
        "data": {"train": {"name": "shards", "args": {"path": str(tmp_path / "*.jsonl")}}},
    }
    skip = build_datasets(
        RunConfig.model_validate(base | {"data": base["data"] | {"bad_records": "skip"}})
    )[0]
    loader = build_loader(skip, batch_size=8, collate_fn=lambda s: [r["x"] for r in s])
    assert list(loader) == [[1, 3]]
    assert loader.bad_records.total == 1

    strict = build_datasets(RunConfig.model_validate(base))[0]
    with pytest.raises(BadRecordError, match=r"a\.jsonl, line 2: not a JSON value"):
        list(strict)


class StopsTheRun(Augmented):
    """Augmented; when armed, the worker that reads sample ``at`` sends SIGTERM to the
    training process: a scheduler's stop, mid-epoch, at a batch the prefetch decides."""

    def __init__(self, *, armed: bool) -> None:
        super().__init__()
        self.armed = torch.tensor(int(armed)).share_memory_()

    def __getitem__(self, index: int):
        if index == 5 and get_worker_info() is not None and int(self.armed):
            self.armed.fill_(0)
            os.kill(os.getppid(), signal.SIGTERM)
        return super().__getitem__(index)


@pytest.mark.slow  # three runs that start workers each epoch: ~15 s
def test_training_stopped_mid_epoch_resumes_bitwise_with_workers(tmp_path) -> None:
    """End to end: a run stopped mid-epoch and resumed (workers 2, a dataset that draws
    from torch's RNG in them) ends with the weights of the run that was not stopped."""

    def run(dataset, **where):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(8, 3))  # fmt: skip
        options = {"epochs": 2, "batch_size": BATCH, "num_workers": 2, "seed": 4}
        return stoker.fit(model, dataset, progress="quiet", tensorboard=False, fingerprint="off",
                          every_steps=100, **options, **where)  # fmt: skip

    straight = run(StopsTheRun(armed=False), run_dir=tmp_path / "straight")
    with pytest.raises(TrainingInterrupted, match=r"SIGTERM .*\(epoch 1, .*checkpoint saved"):
        run(StopsTheRun(armed=True), run_dir=tmp_path / "run")
    dataset = StopsTheRun(armed=False)
    resumed = run(dataset, resume=tmp_path / "run")
    assert_bitwise_equal(straight.model.state_dict(), resumed.model.state_dict())
    assert 0 < dataset.reads.total() < 2 * SAMPLES


@pytest.mark.parametrize("sampler", ["weighted", "bucket"])
def test_weighted_and_bucketed_loaders_resume_without_reading_the_head(sampler) -> None:
    options = {"batch_size": BATCH, "seed": 2, "shuffle": True, "sampler": sampler}
    if sampler == "weighted":
        options["weights"] = torch.linspace(0.1, 1.0, SAMPLES)
    dataset = Augmented()
    dataset.lengths = lambda: torch.arange(SAMPLES) % 7 + 1  # what bucketing sorts by
    straight, rng = _epoch(build_loader(dataset, **options))
    fresh = Augmented()
    fresh.lengths = dataset.lengths
    resumed = build_loader(fresh, **options)
    resumed.load_state_dict({"epoch": EPOCH, "batches_delivered": RESUME_AT})
    torch.set_rng_state(rng)
    assert_bitwise_equal(straight[RESUME_AT:], list(resumed))
    assert fresh.reads.total() == sum(len(batch[1]) for batch in straight[RESUME_AT:])
