"""Tests for stoker.data.parquet: ParquetDataset reads only the row groups and columns it needs."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from stoker.data import build_loader  # noqa: E402
from stoker.data import parquet as parquet_module  # noqa: E402
from stoker.data.parquet import ParquetDataset  # noqa: E402
from stoker.data.records import BadRecordError, FilteredBatch  # noqa: E402
from stoker.errors import ConfigError, DataError  # noqa: E402


def columns(n: int, start: int = 0) -> dict[str, np.ndarray]:
    i = np.arange(start, start + n)
    return {
        "a": (i * 1.5).astype(np.float32),
        "b": (i * -2).astype(np.float64),
        "c": (i % 2 == 0),
        "y": (i % 3).astype(np.int64),
    }


def write(path: Path, data: dict, row_group_size: int = 10) -> None:
    pq.write_table(pa.table(data), path, row_group_size=row_group_size)


def expected(index: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray]:
    i = np.asarray(index)
    features = np.stack([i * 1.5, i * -2.0, (i % 2 == 0) * 1.0], axis=1).astype(np.float32)
    return features, i % 3


@pytest.fixture
def two_files(tmp_path: Path) -> Path:
    folder = tmp_path / "data"
    folder.mkdir()
    write(folder / "part-0.parquet", columns(25))  # row groups of 10, 10, 5
    write(folder / "part-1.parquet", columns(15, start=25))  # 10, 5
    return folder


class ReadSpy:
    """Counts ParquetFile.read_row_group calls and records the columns asked for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, list[str]]] = []
        original = pq.ParquetFile.read_row_group

        def spy(handle, i, columns=None, **kwargs):
            self.calls.append((i, list(columns or [])))
            return original(handle, i, columns=columns, **kwargs)

        monkeypatch.setattr(pq.ParquetFile, "read_row_group", spy)


def test_values_for_indices_across_files(two_files: Path) -> None:
    ds = ParquetDataset(two_files, target="y")
    assert len(ds) == 40
    assert ds.feature_names == ("a", "b", "c") and ds.target_name == "y"
    indices = [39, 0, 24, 25, 11, 11, -1]
    features, target = ds.__getitems__(indices)
    assert features.dtype == torch.float32 and target.dtype == torch.int64
    want_x, want_y = expected([39, 0, 24, 25, 11, 11, 39])
    np.testing.assert_array_equal(features.numpy(), want_x)
    np.testing.assert_array_equal(target.numpy(), want_y)
    x, y = ds[26]
    np.testing.assert_array_equal(x.numpy(), expected([26])[0][0])
    assert y.item() == 26 % 3 and y.dim() == 0


def test_getitems_equals_stacked_getitem(two_files: Path) -> None:
    ds = ParquetDataset(two_files, target="y")
    indices = [33, 5, 5, 18, 0]
    features, target = ds.__getitems__(indices)
    assert torch.equal(features, torch.stack([ds[i][0] for i in indices]))
    assert torch.equal(target, torch.stack([ds[i][1] for i in indices]))


def test_a_batch_in_one_row_group_reads_it_once_with_only_the_needed_columns(
    two_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = ParquetDataset(two_files, features=["a"], target="y")
    spy = ReadSpy(monkeypatch)
    features, _ = ds.__getitems__([12, 10, 19])
    assert spy.calls == [(1, ["a", "y"])]
    assert features.shape == (3, 1)
    np.testing.assert_array_equal(features[:, 0].numpy(), np.array([12, 10, 19]) * 1.5)
    ds.__getitems__([15, 11])  # the same group again: from the cache
    assert len(spy.calls) == 1
    ds.__getitems__([9, 20, 30])  # three more groups, in two files
    assert sorted(spy.calls[1:]) == [(0, ["a", "y"]), (0, ["a", "y"]), (2, ["a", "y"])]


def test_the_cache_keeps_only_the_last_row_groups(
    two_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = ParquetDataset(two_files, target="y", cache_row_groups=1)
    spy = ReadSpy(monkeypatch)
    for index in [0, 10, 0, 1]:
        ds.__getitems__([index])
    assert [i for i, _ in spy.calls] == [0, 1, 0]
    with pytest.raises(ConfigError, match="cache_row_groups"):
        ParquetDataset(two_files, cache_row_groups=-1)


def test_each_decoded_row_group_hands_arrows_memory_back(
    two_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Arrow's allocator would keep a decoded group's freed buffers resident."""
    pool, released = pa.default_memory_pool(), []

    class PoolSpy:
        def release_unused(self) -> None:
            released.append(True)
            pool.release_unused()

    monkeypatch.setattr(pa, "default_memory_pool", PoolSpy)
    ds = ParquetDataset(two_files, target="y", cache_row_groups=0)
    features, _ = ds.__getitems__([0, 12, 30])  # three row groups, in two files
    assert len(released) == 3
    np.testing.assert_array_equal(features.numpy(), expected([0, 12, 30])[0])


def test_without_a_target_samples_have_features_only(two_files: Path) -> None:
    ds = ParquetDataset(two_files / "part-1.parquet", features=["b", "a"])
    (features,) = ds.__getitems__([0, 14])
    np.testing.assert_array_equal(features.numpy(), [[-50.0, 37.5], [-78.0, 58.5]])
    assert ds.targets is None


def test_float_target_and_targets(tmp_path: Path) -> None:
    data = {"x": np.arange(6.0), "t": np.arange(6.0) / 4}
    write(tmp_path / "f.parquet", data, row_group_size=4)
    ds = ParquetDataset(tmp_path / "f.parquet", target="t")
    _, target = ds.__getitems__([5, 1])
    assert target.dtype == torch.float32 and target.tolist() == [1.25, 0.25]
    assert ds.targets.tolist() == (np.arange(6.0) / 4).tolist()


def bad_file(tmp_path: Path) -> Path:
    path = tmp_path / "bad.parquet"
    table = pa.table(
        {
            "a": pa.array([1.0, 2.0, None, 4.0, 5.0, 6.0], pa.float32()),
            "s": pa.array(["1", "2.5", "3", "x", "5", "6"]),
            "y": pa.array([0, 1, 0, 1, None, 1], pa.int64()),
        }
    )
    pq.write_table(table, path, row_group_size=4)
    return path


def test_a_bad_record_error_names_file_row_and_column(tmp_path: Path) -> None:
    path = bad_file(tmp_path)
    ds = ParquetDataset(path, features=["a", "s"], target="y")
    np.testing.assert_array_equal(ds.__getitems__([1, 0])[0].numpy(), [[2.0, 2.5], [1.0, 1.0]])
    with pytest.raises(BadRecordError) as info:
        ds.__getitems__([0, 2])
    message = str(info.value)
    assert "bad.parquet" in message and "row 2" in message and "column 'a' is null" in message
    with pytest.raises(BadRecordError, match="column 's' value 'x' is not a number"):
        ds.__getitems__([3])
    with pytest.raises(BadRecordError, match=r"row 4 \(dataset index 4\).*column 'y' is null"):
        ds.__getitems__([4])


def test_skip_returns_good_rows_and_bad_reasons(tmp_path: Path) -> None:
    ds = ParquetDataset(bad_file(tmp_path), features=["a", "s"], target="y", bad_records="skip")
    batch = ds.__getitems__([5, 2, 0, 3, 4])
    assert isinstance(batch, FilteredBatch)
    features, target = batch.batch
    np.testing.assert_array_equal(features.numpy(), [[6.0, 6.0], [1.0, 1.0]])
    assert target.tolist() == [1, 0]
    assert [b.location for b in batch.bad] == [
        "row 2 (dataset index 2)",
        "row 3 (dataset index 3)",
        "row 4 (dataset index 4)",
    ]
    assert [b.reason for b in batch.bad] == [
        "column 'a' is null",
        "column 's' value 'x' is not a number",
        "column 'y' is null",
    ]
    assert all(b.source.endswith("bad.parquet") for b in batch.bad)
    only_bad = ds.__getitems__([2])
    assert isinstance(only_bad, FilteredBatch) and only_bad.batch is None
    assert ds[2].reason == "column 'a' is null"
    assert isinstance(ds.__getitems__([0, 1]), tuple)


def test_row_within_file_and_dataset_index_differ_in_a_second_file(tmp_path: Path) -> None:
    write(tmp_path / "a.parquet", columns(5))
    table = pa.table({"a": pa.array([1.0, None]), "b": [1.0, 2.0], "c": [True, False], "y": [0, 1]})
    pq.write_table(table, tmp_path / "b.parquet")
    ds = ParquetDataset(tmp_path, target="y")
    with pytest.raises(BadRecordError, match=r"b\.parquet, row 1 \(dataset index 6\)"):
        ds.__getitems__([6])


def test_missing_paths_and_columns_are_named(tmp_path: Path, two_files: Path) -> None:
    with pytest.raises(DataError, match="nowhere.parquet"):
        ParquetDataset(tmp_path / "nowhere.parquet")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no \\*.parquet files"):
        ParquetDataset(empty)
    with pytest.raises(DataError, match=r"part-0.parquet has no column\(s\) \['z'\]"):
        ParquetDataset(two_files, features=["a", "z"])
    (tmp_path / "fake.parquet").write_text("a,b\n1,2\n")
    with pytest.raises(DataError, match="fake.parquet"):
        ParquetDataset(tmp_path / "fake.parquet")


def test_default_features_must_be_numbers(tmp_path: Path) -> None:
    path = bad_file(tmp_path)
    with pytest.raises(DataError, match=r"\['s \(string\)'\]"):
        ParquetDataset(path, target="y")
    nested = tmp_path / "nested.parquet"
    pq.write_table(pa.table({"v": [[1, 2], [3]], "y": [0, 1]}), nested)
    with pytest.raises(DataError, match="not numbers"):
        ParquetDataset(nested, features=["v"], target="y")


def test_schema_lists_columns_and_types(two_files: Path) -> None:
    ds = ParquetDataset(two_files, target="y")
    assert ds.schema() == {"a": "float", "b": "double", "c": "bool", "y": "int64"}
    assert ds.row_group_offsets() == [0, 10, 20, 25, 35, 40]


def test_missing_pyarrow_names_the_extra(two_files: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("pyarrow", "pyarrow.parquet", "pyarrow.compute"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError) as info:
        ParquetDataset(two_files)
    assert "stoker[parquet]" in str(info.value)


def test_pickling_leaves_handles_and_cache_behind(two_files: Path) -> None:
    ds = ParquetDataset(two_files, target="y")
    ds.__getitems__([0, 30])
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._handles is None and not clone._cache
    np.testing.assert_array_equal(clone.__getitems__([31])[0].numpy(), expected([31])[0])


def test_build_loader_batches_and_workers(two_files: Path) -> None:
    ds = ParquetDataset(two_files, target="y")
    batches = list(build_loader(ds, batch_size=16))
    assert [len(b[0]) for b in batches] == [16, 16, 8]
    want_x, want_y = expected(np.arange(40))
    np.testing.assert_array_equal(torch.cat([b[0] for b in batches]).numpy(), want_x)
    shuffled = list(build_loader(ds, batch_size=16, shuffle=True, num_workers=2, seed=1))
    assert len(shuffled) == 3
    features = torch.cat([b[0] for b in shuffled]).numpy()
    target = torch.cat([b[1] for b in shuffled]).numpy()
    rows = (features[:, 0] / 1.5).round().astype(int)
    assert sorted(rows.tolist()) == list(range(40))
    np.testing.assert_array_equal(target, want_y[rows])


def test_every_file_needs_the_columns_of_the_first(tmp_path: Path) -> None:
    write(tmp_path / "a.parquet", columns(3))
    pq.write_table(pa.table({"a": [1.0], "y": [0]}), tmp_path / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet has no column\(s\) \['b', 'c'\]"):
        ParquetDataset(tmp_path, target="y")


def test_a_full_cache_decodes_into_the_evicted_groups_array(two_files: Path) -> None:
    """Group after group, the features array of the group the cache drops is refilled:
    never a group more than the cache holds, and no allocation per group."""
    ds = ParquetDataset(two_files, target="y", cache_row_groups=2)
    ds.__getitems__([0, 10])  # groups 0 and 1 (10 rows each) fill the cache
    oldest = ds._cache[0].features
    features, target = ds.__getitems__([25, 26])  # group 3: 10 rows, evicts group 0
    assert list(ds._cache) == [1, 3]
    assert ds._cache[3].features is oldest
    want_x, want_y = expected([25, 26])
    np.testing.assert_array_equal(features.numpy(), want_x)
    np.testing.assert_array_equal(target.numpy(), want_y)
    second = ds._cache[1].features
    ds.__getitems__([20])  # group 2 has 5 rows: the evicted 10-row array does not fit
    assert list(ds._cache) == [3, 2] and ds._cache[2].features is not second
    assert ds._cache[2].features.shape == (5, 3)
    features, _ = ds.__getitems__([0, 24, 26, 39])  # refilled arrays, right values
    np.testing.assert_array_equal(features.numpy(), expected([0, 24, 26, 39])[0])


def test_no_arrow_memory_outlives_a_decode(tmp_path: Path) -> None:
    """Pre-buffering would keep the raw column chunks of the last group read alive.

    Measured in a fresh interpreter (Arrow's allocator is process-wide: what earlier tests
    left there would move the count), and given up to 2 s to settle: Arrow's reader
    threads drop their last references to a decoded column a moment after the read has
    returned, so an exact count right after the call is a race (it read 240,768 bytes
    now and then). Pre-buffered chunks, by contrast, stay until the next read.
    """
    write(tmp_path / "big.parquet", columns(20_000), row_group_size=10_000)
    script = (
        "import json, time\n"
        "import pyarrow as pa\n"
        "from stoker.data.parquet import ParquetDataset\n"
        f"ds = ParquetDataset({str(tmp_path / 'big.parquet')!r}, target='y', cache_row_groups=0)\n"
        "before = pa.total_allocated_bytes()\n"
        "features, _ = ds.__getitems__([5, 15_000])\n"
        "deadline = time.monotonic() + 2.0\n"
        "while pa.total_allocated_bytes() != before and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "print(json.dumps([pa.total_allocated_bytes() - before, features.tolist()]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    outlived, features = json.loads(out.stdout)
    assert outlived == 0
    np.testing.assert_array_equal(np.array(features, np.float32), expected([5, 15_000])[0])


def test_plain_numeric_files_never_import_pyarrow_compute(two_files: Path) -> None:
    """pyarrow.compute's wrappers cost ~10 MiB of RSS; plain numbers need none of it."""
    script = (
        "import sys\n"
        "from stoker.data.parquet import ParquetDataset\n"
        f"ds = ParquetDataset({str(two_files)!r}, target='y')\n"
        "x, y = ds.__getitems__([0, 12, 39])\n"
        "assert x.shape == (3, 3) and y.tolist() == [0, 0, 0], (x, y)\n"
        "print('pyarrow.compute' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "values",
    [
        np.arange(-40, 40, dtype=np.int8),
        np.arange(70_000, 70_080, dtype=np.int32),
        np.arange(80, dtype=np.uint16),
        np.linspace(-3, 3, 80).astype(np.float16),
        np.linspace(-3, 3, 80).astype(np.float32),
        np.linspace(-3, 3, 80),
        np.arange(80) % 3 == 0,
    ],
    ids=["int8", "int32", "uint16", "float16", "float32", "float64", "bool"],
)
def test_columns_are_read_from_their_buffers_as_to_numpy_reads_them(values: np.ndarray) -> None:
    # Chunks of several sizes, sliced so that each starts at an offset into its buffers
    # (a bit offset inside a byte, for booleans).
    whole = pa.array(values)
    column = pa.chunked_array([whole.slice(3, 30), whole.slice(35, 1), whole.slice(41, 37)])
    read = parquet_module._numbers(pa, column)
    np.testing.assert_array_equal(read, column.to_numpy())
    assert read.dtype == column.to_numpy().dtype
    one_chunk = pa.chunked_array([whole.slice(5, 50)])
    np.testing.assert_array_equal(parquet_module._numbers(pa, one_chunk), values[5:55])
