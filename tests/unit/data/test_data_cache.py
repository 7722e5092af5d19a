"""Tests for stoker.data.cache: CachedDataset in memory and disk mode, with workers."""

from __future__ import annotations

import fcntl
import json
import multiprocessing
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from stoker.data.cache import CachedDataset
from stoker.errors import ConfigError, DataError


class Counted(Dataset):
    """Deterministic samples; every load is appended to a log file, from any process."""

    def __init__(self, log: Path, n: int = 20, dim: int = 3, *, as_dict: bool = False) -> None:
        self.log, self.n, self.dim, self.as_dict = log, n, dim, as_dict
        self.targets = torch.arange(n) % 2

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        # O_APPEND writes of one short line are atomic, so workers can share the log.
        with open(self.log, "a") as handle:
            handle.write(f"{i}\n")
        x = torch.arange(self.dim, dtype=torch.float32) + i
        if self.as_dict:
            return {"x": x, "id": np.int64(i), "weight": float(i) / 2, "keep": i % 2 == 0}
        return x, i

    def loads(self) -> list[int]:
        return [int(line) for line in self.log.read_text().split()] if self.log.exists() else []


class Varying(Dataset):
    def __len__(self) -> int:
        return 5

    def __getitem__(self, i: int):
        return torch.zeros(i + 1), i


class Texts(Dataset):
    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int):
        return torch.zeros(2), f"text {i}"


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


# ------------------------------------------------------------------ memory mode


def test_memory_mode_loads_each_sample_once(tmp_path: Path) -> None:
    base = Counted(tmp_path / "log")
    cached = CachedDataset(base)
    first = [cached[i] for i in range(20)]
    second = [cached[i] for i in range(20)]
    assert sorted(base.loads()) == list(range(20))
    assert (cached.misses, cached.hits, cached.num_cached) == (20, 20, 20)
    assert all(same(a, b) for a, b in zip(first, second, strict=True))
    assert same(cached[-1], base[19]) and cached.hits == 21
    with pytest.raises(IndexError, match="out of range"):
        cached[20]


def test_warm_fills_the_cache_before_workers_fork(tmp_path: Path) -> None:
    base = Counted(tmp_path / "log", n=16)
    cached = CachedDataset(base).warm(progress=False)
    assert cached.num_cached == 16 and len(base.loads()) == 16
    loader = DataLoader(cached, batch_size=4, num_workers=2, multiprocessing_context="fork")
    xs = torch.cat([x for x, _ in loader])
    assert len(base.loads()) == 16, "forked workers inherit the warm cache"
    assert torch.equal(xs[:, 0], torch.arange(16.0))


def test_targets_pass_through(tmp_path: Path) -> None:
    cached = CachedDataset(Counted(tmp_path / "log"))
    assert torch.equal(cached.targets, torch.arange(20) % 2)
    assert not hasattr(CachedDataset(Varying()), "targets")


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"mode": "ram"}, ConfigError, "expected 'memory' or 'disk'"),
        ({"mode": "disk"}, ConfigError, "needs a folder"),
        ({"path": "somewhere"}, ConfigError, "keeps no files"),
    ],
)
def test_bad_options_are_errors(options: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        CachedDataset(Varying(), **options)


def test_streams_are_refused() -> None:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(DataError, match="IterableDataset"):
        CachedDataset(Stream())


# ------------------------------------------------------------------ disk mode


@pytest.mark.parametrize("as_dict", [False, True])
def test_disk_mode_serves_the_second_pass_from_disk(tmp_path: Path, as_dict: bool) -> None:
    base = Counted(tmp_path / "log", as_dict=as_dict)
    folder = tmp_path / "cache"
    cached = CachedDataset(base, mode="disk", path=folder)
    first = [cached[i] for i in range(20)]
    second = [cached[i] for i in range(20)]
    assert sorted(base.loads()) == list(range(20))
    assert (cached.misses, cached.hits, cached.num_cached) == (20, 20, 20)
    assert all(same(a, b) for a, b in zip(first, second, strict=True))

    fresh = CachedDataset(base, mode="disk", path=folder)
    third = [fresh[i] for i in range(20)]
    assert len(base.loads()) == 20, "a new object on the same folder reads from disk"
    assert (fresh.misses, fresh.hits) == (0, 20)
    assert all(same(a, b) for a, b in zip(first, third, strict=True))
    meta = json.loads((folder / "meta.json").read_text())
    assert (meta["length"], len(meta["fields"])) == (20, 4 if as_dict else 2)


def test_disk_mode_returns_copies(tmp_path: Path) -> None:
    cached = CachedDataset(Counted(tmp_path / "log"), mode="disk", path=tmp_path / "cache")
    cached[3]
    x, _ = cached[3]
    x.fill_(-1)
    assert torch.equal(cached[3][0], torch.tensor([3.0, 4.0, 5.0]))


def test_disk_mode_keeps_dtypes_numpy_lacks(tmp_path: Path) -> None:
    values = torch.randn(4, 3).to(torch.bfloat16)

    class Half(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int):
            return values[i]

    CachedDataset(Half(), mode="disk", path=tmp_path / "cache").warm()
    fresh = CachedDataset(Half(), mode="disk", path=tmp_path / "cache")
    got = torch.stack([fresh[i] for i in range(4)])
    assert fresh.hits == 4 and got.dtype == torch.bfloat16 and torch.equal(got, values)


def test_two_workers_fill_one_disk_cache(tmp_path: Path) -> None:
    base = Counted(tmp_path / "log", n=64, dim=5)
    folder = tmp_path / "cache"
    cached = CachedDataset(base, mode="disk", path=folder)
    loader = DataLoader(cached, batch_size=4, num_workers=2, shuffle=True)
    seen = torch.cat([x for x, _ in loader])
    assert sorted(seen[:, 0].tolist()) == [float(i) for i in range(64)]
    assert sorted(base.loads()) == list(range(64))

    fresh = CachedDataset(base, mode="disk", path=folder)
    assert fresh.num_cached == 64
    for i in range(64):
        x, label = fresh[i]
        assert torch.equal(x, torch.arange(5, dtype=torch.float32) + i) and label == i
    assert len(base.loads()) == 64 and fresh.misses == 0


def _warm(path: str, log: str) -> None:
    CachedDataset(Counted(Path(log), n=200, dim=64), mode="disk", path=path).warm()


def test_processes_racing_on_the_same_rows_never_corrupt_them(tmp_path: Path) -> None:
    # Both processes miss on the same indices at once, so they write the same rows.
    folder, log = tmp_path / "cache", tmp_path / "log"
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_warm, args=(str(folder), str(log))) for _ in range(2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    assert [worker.exitcode for worker in workers] == [0, 0]
    fresh = CachedDataset(Counted(log, n=200, dim=64), mode="disk", path=folder)
    loads = len(fresh.dataset.loads())
    assert 200 <= loads <= 400
    for i in range(200):
        x, label = fresh[i]
        assert torch.equal(x, torch.arange(64, dtype=torch.float32) + i) and label == i
    assert fresh.misses == 0


def test_writers_wait_for_the_folder_lock(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    cached = CachedDataset(Counted(tmp_path / "log", n=4), mode="disk", path=folder)
    held = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        writer = multiprocessing.get_context("fork").Process(target=cached.warm)
        writer.start()
        writer.join(timeout=0.5)
        assert writer.is_alive(), "a writer must wait while another process holds the lock"
        assert cached.num_cached == 0
    finally:
        fcntl.flock(held, fcntl.LOCK_UN)
        os.close(held)
    writer.join(timeout=30)
    assert writer.exitcode == 0 and cached.num_cached == 4


def test_a_row_is_marked_filled_only_after_its_data(tmp_path: Path) -> None:
    base, folder = Counted(tmp_path / "log", n=4), tmp_path / "cache"
    cached = CachedDataset(base, mode="disk", path=folder)
    cached[0]

    def disk_full(index: int, value: object) -> None:
        raise OSError("No space left on device")

    cached._store.rows[1].write = disk_full  # the label field fails after the features
    with pytest.raises(OSError, match="No space"):
        cached[1]
    fresh = CachedDataset(base, mode="disk", path=folder)
    assert fresh.num_cached == 1
    assert same(fresh[1], (torch.tensor([1.0, 2.0, 3.0]), 1)) and fresh.misses == 1


def test_a_folder_made_for_other_data_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    CachedDataset(Counted(tmp_path / "log", n=20), mode="disk", path=folder)[0]
    with pytest.raises(DataError, match="made for different data") as caught:
        CachedDataset(Counted(tmp_path / "log", n=21), mode="disk", path=folder)
    assert "20 samples" in str(caught.value) and "21 samples" in str(caught.value)
    assert "delete the folder" in caught.value.hint

    wider = CachedDataset(Counted(tmp_path / "log", n=20, dim=4), mode="disk", path=folder)
    with pytest.raises(DataError, match="made for different data"):
        wider[1]


def test_a_folder_of_other_files_is_refused(tmp_path: Path) -> None:
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(DataError, match="holds other files"):
        CachedDataset(Varying(), mode="disk", path=tmp_path / "images")


def test_variable_shapes_are_refused_in_disk_mode(tmp_path: Path) -> None:
    cached = CachedDataset(Varying(), mode="disk", path=tmp_path / "cache")
    cached[0]
    with pytest.raises(DataError, match=r"sample 2 field '0' has shape \(3,\)") as caught:
        cached[2]
    assert "mode='memory'" in caught.value.hint
    assert cached.num_cached == 1
    assert CachedDataset(Varying())[2][0].shape == (3,), "memory mode takes any shape"


def test_fields_disk_mode_cannot_store_are_refused(tmp_path: Path) -> None:
    cached = CachedDataset(Texts(), mode="disk", path=tmp_path / "cache")
    with pytest.raises(DataError, match="field '1' of sample 0: a str"):
        cached[0]


@pytest.mark.parametrize("mode", ["memory", "disk"])
def test_pickled_copies_keep_the_cache(tmp_path: Path, mode: str) -> None:
    base = Counted(tmp_path / "log", n=6)
    path = tmp_path / "cache" if mode == "disk" else None
    cached = CachedDataset(base, mode=mode, path=path).warm()
    copy = pickle.loads(pickle.dumps(cached))
    assert (copy.hits, copy.misses) == (0, 0)
    assert all(same(copy[i], cached[i]) for i in range(6))
    assert copy.hits == 6 and len(base.loads()) == 6
    assert f"mode='{mode}'" in repr(copy) and "cached=6/6" in repr(copy)
