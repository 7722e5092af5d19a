"""Tests for stoker.data.convert: CSV to Parquet and .npy, streamed, with a full report."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from stoker.data.convert import convert_csv
from stoker.data.memmap import NpyDataset
from stoker.data.records import BadRecordError
from stoker.errors import ConfigError, DataError

pq = pytest.importorskip("pyarrow.parquet")

from stoker.data.parquet import ParquetDataset  # noqa: E402


def write_csv(path: Path, n: int = 23) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(n, 3)).round(4).astype(np.float32)
    target = rng.integers(0, 5, size=n)
    rows = [
        f"{a!r},{b!r},{c!r},{t}" for (a, b, c), t in zip(features.tolist(), target, strict=True)
    ]
    path.write_text("f1,f2,f3,cls\n" + "\n".join(rows) + "\n")
    return features, target


def bad_csv(path: Path) -> Path:
    path.write_text("f1,f2,cls\n1,2,0\n3,x,1\n5,6,2\n7,8\n9,10,3\n")
    return path


def test_csv_to_parquet_round_trips(tmp_path: Path) -> None:
    features, target = write_csv(tmp_path / "in.csv")
    report = convert_csv(
        tmp_path / "in.csv", tmp_path / "out.parquet", to="parquet", target="cls", chunk_rows=10
    )
    assert report.rows_written == 23 and report.rows_skipped == 0 and report.skipped == ()
    assert report.outputs == (tmp_path / "out.parquet",)
    assert report.bytes_written == (tmp_path / "out.parquet").stat().st_size > 0
    assert report.feature_names == ("f1", "f2", "f3") and report.target_name == "cls"
    metadata = pq.ParquetFile(tmp_path / "out.parquet").metadata
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [10, 10, 3]
    ds = ParquetDataset(tmp_path / "out.parquet", target="cls")
    assert ds.schema() == {"f1": "float", "f2": "float", "f3": "float", "cls": "int64"}
    x, y = ds.__getitems__(list(range(23)))
    np.testing.assert_array_equal(x.numpy(), features)
    np.testing.assert_array_equal(y.numpy(), target)
    assert not (tmp_path / "out.parquet.partial").exists()


def test_csv_to_npy_round_trips(tmp_path: Path) -> None:
    features, target = write_csv(tmp_path / "in.csv")
    report = convert_csv(
        tmp_path / "in.csv", tmp_path / "npy", to="npy", target="cls", chunk_rows=7
    )
    assert report.outputs == (tmp_path / "npy" / "features.npy", tmp_path / "npy" / "target.npy")
    assert report.rows_written == 23
    assert report.bytes_written == sum(p.stat().st_size for p in report.outputs)
    stored = np.load(tmp_path / "npy" / "features.npy")
    assert stored.dtype == np.float32 and stored.shape == (23, 3)
    np.testing.assert_array_equal(stored, features)
    labels = np.load(tmp_path / "npy" / "target.npy")
    assert labels.dtype == np.int64
    np.testing.assert_array_equal(labels, target)
    ds = NpyDataset(tmp_path / "npy")
    assert ds.names == ("features", "target")
    np.testing.assert_array_equal(ds.__getitems__([22, 0])[0].numpy(), features[[22, 0]])
    assert sorted(p.name for p in (tmp_path / "npy").iterdir()) == ["features.npy", "target.npy"]


def test_npy_without_a_target_writes_features_only(tmp_path: Path) -> None:
    features, _ = write_csv(tmp_path / "in.csv", n=5)
    report = convert_csv(tmp_path / "in.csv", tmp_path / "npy", to="npy", features=["f2", "f1"])
    assert report.outputs == (tmp_path / "npy" / "features.npy",)
    np.testing.assert_array_equal(np.load(report.outputs[0]), features[:, [1, 0]])


@pytest.mark.parametrize("to", ["parquet", "npy"])
def test_skipped_rows_are_counted_and_listed(tmp_path: Path, to: str) -> None:
    src = bad_csv(tmp_path / "bad.csv")
    dst = tmp_path / ("out.parquet" if to == "parquet" else "npy")
    report = convert_csv(src, dst, to=to, target="cls", chunk_rows=2, bad_records="skip")
    assert report.rows_written == 3 and report.rows_skipped == 2
    assert [(s.location, s.reason) for s in report.skipped] == [
        ("line 3", "column 'f2' value 'x' is not a number"),
        ("line 5", "expected 3 fields as in the header, got 2"),
    ]
    assert "line 3" in report.summary() and "2 skipped" in report.summary()
    if to == "npy":
        features = np.load(dst / "features.npy")
        assert features.shape == (3, 2)  # sized exactly, not for the 5 lines counted
        np.testing.assert_array_equal(features, [[1, 2], [5, 6], [9, 10]])
        assert np.load(dst / "target.npy").tolist() == [0, 2, 3]
        assert sorted(p.name for p in dst.iterdir()) == ["features.npy", "target.npy"]
    else:
        x, y = ParquetDataset(dst, target="cls").__getitems__([0, 1, 2])
        assert x.tolist() == [[1, 2], [5, 6], [9, 10]] and y.tolist() == [0, 2, 3]


@pytest.mark.parametrize("to", ["parquet", "npy"])
def test_a_bad_row_under_error_leaves_nothing_behind(tmp_path: Path, to: str) -> None:
    src = bad_csv(tmp_path / "bad.csv")
    out = tmp_path / "out"
    out.mkdir()
    dst = out / "x.parquet" if to == "parquet" else out
    with pytest.raises(BadRecordError, match=r"bad\.csv, line 3: column 'f2'"):
        convert_csv(src, dst, to=to, target="cls", chunk_rows=1)
    assert list(out.iterdir()) == []
    with pytest.raises(BadRecordError):
        convert_csv(src, out / "new", to="npy", target="cls", chunk_rows=1)
    assert list(out.iterdir()) == []  # not even the folder it made


def test_existing_outputs_need_overwrite(tmp_path: Path) -> None:
    write_csv(tmp_path / "in.csv", n=4)
    convert_csv(tmp_path / "in.csv", tmp_path / "o.parquet", to="parquet")
    with pytest.raises(DataError, match="overwrite"):
        convert_csv(tmp_path / "in.csv", tmp_path / "o.parquet", to="parquet")
    report = convert_csv(tmp_path / "in.csv", tmp_path / "o.parquet", to="parquet", overwrite=True)
    assert report.rows_written == 4


def test_nothing_to_write_and_bad_options(tmp_path: Path) -> None:
    (tmp_path / "h.csv").write_text("a,b\n")
    for to in ("parquet", "npy"):
        with pytest.raises(DataError, match="no rows to write"):
            convert_csv(tmp_path / "h.csv", tmp_path / f"o-{to}", to=to)
    (tmp_path / "all-bad.csv").write_text("a,b\nx,1\n")
    with pytest.raises(DataError, match="1 skipped; the first skipped: .*line 2"):
        convert_csv(tmp_path / "all-bad.csv", tmp_path / "n", to="npy", bad_records="skip")
    with pytest.raises(DataError, match="missing.csv"):
        convert_csv(tmp_path / "missing.csv", tmp_path / "o", to="npy")
    with pytest.raises(ConfigError, match="to='csv'"):
        convert_csv(tmp_path / "h.csv", tmp_path / "o", to="csv")  # type: ignore[arg-type]


def test_missing_pyarrow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_csv(tmp_path / "in.csv", n=3)
    for name in ("pyarrow", "pyarrow.parquet", "pyarrow.compute"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ConfigError, match=r"stoker\[parquet\]"):
        convert_csv(tmp_path / "in.csv", tmp_path / "o.parquet", to="parquet")
    report = convert_csv(tmp_path / "in.csv", tmp_path / "npy", to="npy")  # needs no pyarrow
    assert report.rows_written == 3
