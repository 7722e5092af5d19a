"""Tests for stoker.data.tabular: CsvDataset over a line index, and iter_csv_chunks."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.data import build_loader, tabular
from stoker.data.records import BadRecordError, FilteredBatch
from stoker.data.tabular import CsvDataset, iter_csv_chunks
from stoker.errors import ConfigError, DataError


def table(n: int = 30) -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(n)
    features = np.stack([i * 0.5, i * -3.0, i**2], axis=1).astype(np.float32)
    return features, i % 4


def write_csv(path: Path, n: int = 30, newline: str = "\n") -> tuple[np.ndarray, np.ndarray]:
    features, target = table(n)
    lines = ["x1,x2,x3,label"]
    lines += [f"{a:g},{b:g},{c:g},{t}" for (a, b, c), t in zip(features, target, strict=True)]
    path.write_text(newline.join(lines) + newline, newline="")
    return features, target


def test_values_for_indices(tmp_path: Path) -> None:
    features, target = write_csv(tmp_path / "t.csv")
    ds = CsvDataset(tmp_path / "t.csv", target="label")
    assert len(ds) == 30 and ds.feature_names == ("x1", "x2", "x3")
    x, y = ds.__getitems__([29, 0, 13, 13, -2])
    assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (5, 3)
    np.testing.assert_array_equal(x.numpy(), features[[29, 0, 13, 13, 28]])
    np.testing.assert_array_equal(y.numpy(), target[[29, 0, 13, 13, 28]])
    sx, sy = ds[7]
    np.testing.assert_array_equal(sx.numpy(), features[7])
    assert sy.item() == 3 and sy.dim() == 0


def test_getitems_equals_stacked_getitem(tmp_path: Path) -> None:
    write_csv(tmp_path / "t.csv")
    ds = CsvDataset(tmp_path / "t.csv", features=["x3", "x1"], target="label")
    indices = [20, 3, 3, 11]
    x, y = ds.__getitems__(indices)
    assert torch.equal(x, torch.stack([ds[i][0] for i in indices]))
    assert torch.equal(y, torch.stack([ds[i][1] for i in indices]))
    assert x[1].tolist() == [9.0, 1.5]


def test_crlf_blank_lines_and_quotes(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_bytes(b'a;"b";y\r\n1;2;0\r\n\r\n\n"3";4.5;1\r\n5;6;2')
    ds = CsvDataset(path, delimiter=";", target="y")
    assert ds.columns == ("a", "b", "y") and len(ds) == 3
    x, y = ds.__getitems__([2, 1, 0])
    assert x.tolist() == [[5.0, 6.0], [3.0, 4.5], [1.0, 2.0]] and y.tolist() == [2, 1, 0]


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 7, 1 << 20])
def test_index_is_the_same_whatever_the_read_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk_bytes: int
) -> None:
    monkeypatch.setattr(tabular, "_INDEX_CHUNK_BYTES", chunk_bytes)
    path = tmp_path / "t.csv"
    path.write_bytes(b"a,y\n1,0\n\n2,1\r\n\r\n\r\n3,0\n\n")
    ds = CsvDataset(path, target="y", bad_records="skip")
    assert len(ds) == 3
    assert ds.__getitems__([0, 1, 2])[0].tolist() == [[1.0], [2.0], [3.0]]


def test_target_dtype_auto_and_explicit(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    path.write_text("x,t\n1,0.5\n2,3\n")
    assert CsvDataset(path, target="t")[1][1].dtype == torch.float32
    assert CsvDataset(path, target="t")[1][1].item() == 3.0
    path.write_text("x,t\n1,1\n2,3\n")
    assert CsvDataset(path, target="t")[0][1].dtype == torch.int64
    assert CsvDataset(path, target="t", target_dtype="float32")[0][1].dtype == torch.float32
    (features,) = CsvDataset(path)[1]
    assert features.tolist() == [2.0, 3.0]
    path.write_text("x,t\n1,\n2,3\n")  # an empty target is a bad row, not a float
    ds = CsvDataset(path, target="t", bad_records="skip")
    assert ds[1][1].dtype == torch.int64 and ds[0].reason == "column 't' is empty"


def test_int64_labels_may_be_written_as_whole_floats(tmp_path: Path) -> None:
    """pandas writes an integer column that had a missing value as 0.0, 1.0, ..."""
    path = tmp_path / "labels.csv"
    path.write_text("x,y\n1,0.0\n2,1.0\n3,2\n")
    ds = CsvDataset(path, target="y", target_dtype="int64")
    assert [ds[i][1].item() for i in range(3)] == [0, 1, 2]
    assert ds[0][1].dtype == torch.int64
    assert CsvDataset(path, target="y")[0][1].dtype == torch.float32  # auto: floats stay
    path.write_text("x,y\n1,0.0\n2,1.5\n")
    with pytest.raises(BadRecordError, match="line 3: column 'y' value '1.5' is not an integer"):
        CsvDataset(path, target="y", target_dtype="int64")[1]


def bad_csv(path: Path) -> Path:
    path.write_text("a,b,y\n1,2,0\n3,oops,1\n\n5,6\n7,8,1.5\n9,10,1\n,12,0\n")
    return path


def test_bad_records_name_the_line_column_and_value(tmp_path: Path) -> None:
    ds = CsvDataset(bad_csv(tmp_path / "bad.csv"), target="y", target_dtype="int64")
    assert ds.__getitems__([0, 4])[0].tolist() == [[1.0, 2.0], [9.0, 10.0]]
    with pytest.raises(BadRecordError) as info:
        ds.__getitems__([0, 1])
    assert str(info.value).startswith("bad record in ")
    assert "bad.csv, line 3: column 'b' value 'oops' is not a number" in str(info.value)
    with pytest.raises(BadRecordError, match="line 5: expected 3 fields as in the header, got 2"):
        ds.__getitems__([2])
    with pytest.raises(BadRecordError, match="line 6: column 'y' value '1.5' is not an integer"):
        ds.__getitems__([3])
    with pytest.raises(BadRecordError, match="line 8: column 'a' is empty"):
        ds[5]


def test_skip_returns_a_filtered_batch_in_the_order_asked(tmp_path: Path) -> None:
    ds = CsvDataset(
        bad_csv(tmp_path / "bad.csv"), target="y", target_dtype="int64", bad_records="skip"
    )
    batch = ds.__getitems__([4, 1, 3, 0, 2])
    assert isinstance(batch, FilteredBatch)
    x, y = batch.batch
    assert x.tolist() == [[9.0, 10.0], [1.0, 2.0]] and y.tolist() == [1, 0]
    assert [b.location for b in batch.bad] == ["line 3", "line 5", "line 6"]
    assert batch.bad[0].reason == "column 'b' value 'oops' is not a number"
    assert all(b.source.endswith("bad.csv") for b in batch.bad)
    assert ds[1].location == "line 3"
    assert ds.__getitems__([2]).batch is None


def test_missing_file_columns_and_options(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere.csv"):
        CsvDataset(tmp_path / "nowhere.csv")
    write_csv(tmp_path / "t.csv")
    with pytest.raises(DataError, match=r"no column\(s\) \['z'\]"):
        CsvDataset(tmp_path / "t.csv", target="z")
    with pytest.raises(DataError, match="both a feature and the target"):
        CsvDataset(tmp_path / "t.csv", features=["x1", "label"], target="label")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataError, match="no header"):
        CsvDataset(tmp_path / "empty.csv")
    with pytest.raises(ConfigError, match="bad_records='drop'"):
        CsvDataset(tmp_path / "t.csv", bad_records="drop")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="delimiter"):
        CsvDataset(tmp_path / "t.csv", delimiter=",,")


def test_header_only_file_has_no_rows(tmp_path: Path) -> None:
    (tmp_path / "h.csv").write_text("a,b\n")
    assert len(CsvDataset(tmp_path / "h.csv")) == 0
    (tmp_path / "h2.csv").write_text("a,b")
    assert len(CsvDataset(tmp_path / "h2.csv")) == 0


def test_a_file_that_changed_since_indexing_is_refused(tmp_path: Path) -> None:
    write_csv(tmp_path / "t.csv")
    ds = CsvDataset(tmp_path / "t.csv", target="label")
    ds.__getitems__([0])
    with (tmp_path / "t.csv").open("a") as stream:
        stream.write("1,2,3,4\n")
    with pytest.raises(DataError, match="changed size"):
        ds.__getitems__([0])


def test_build_loader_batches_and_workers(tmp_path: Path) -> None:
    features, target = write_csv(tmp_path / "t.csv", n=30)
    ds = CsvDataset(tmp_path / "t.csv", target="label")
    batches = list(build_loader(ds, batch_size=8))
    assert [len(b[0]) for b in batches] == [8, 8, 8, 6]
    np.testing.assert_array_equal(torch.cat([b[0] for b in batches]).numpy(), features)
    clone = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(clone[29][0].numpy(), features[29])
    shuffled = list(build_loader(ds, batch_size=8, shuffle=True, num_workers=2, seed=2))
    x = torch.cat([b[0] for b in shuffled]).numpy()
    y = torch.cat([b[1] for b in shuffled]).numpy()
    rows = (x[:, 0] * 2).astype(int)
    assert sorted(rows.tolist()) == list(range(30))
    np.testing.assert_array_equal(y, target[rows])


def test_iter_csv_chunks_yields_parsed_columns(tmp_path: Path) -> None:
    features, target = write_csv(tmp_path / "t.csv", n=30)
    chunks = list(iter_csv_chunks(tmp_path / "t.csv", chunk_rows=8, target="label"))
    assert [len(c.features) for c in chunks] == [8, 8, 8, 6]
    assert chunks[0].feature_names == ("x1", "x2", "x3") and chunks[0].target_name == "label"
    np.testing.assert_array_equal(np.concatenate([c.features for c in chunks]), features)
    np.testing.assert_array_equal(np.concatenate([c.target for c in chunks]), target)
    assert all(c.bad == () for c in chunks)


def test_iter_csv_chunks_lists_skipped_rows(tmp_path: Path) -> None:
    path = bad_csv(tmp_path / "bad.csv")
    chunks = list(iter_csv_chunks(path, chunk_rows=3, target="y", bad_records="skip"))
    assert [c.target.dtype for c in chunks] == [np.float32, np.float32]  # 1.5 in the first rows
    assert [b.location for c in chunks for b in c.bad] == ["line 3", "line 5", "line 8"]
    assert np.concatenate([c.target for c in chunks]).tolist() == [0.0, 1.5, 1.0]
    with pytest.raises(BadRecordError, match="line 3"):
        list(iter_csv_chunks(path, target="y"))
    with pytest.raises(ConfigError, match="chunk_rows"):
        iter_csv_chunks(path, chunk_rows=0)
