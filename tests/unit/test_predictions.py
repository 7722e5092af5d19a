"""Prediction files: the rows of each task and format, written whole or not at all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from stoker.errors import ConfigError, DataError
from stoker.predictions import CsvWriter, NpyWriter, ParquetWriter, open_writer


def test_classification_rows_with_class_names(tmp_path: Path) -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 1.0, 0.0]])
    with ParquetWriter(
        tmp_path / "p.parquet", task="classification", classes=["cat", "dog", "eel"], rows=3
    ) as writer:
        writer.write(logits[:2], torch.tensor([0, 2]))
        writer.write(logits[2:], torch.tensor([0]))
    table = pq.read_table(tmp_path / "p.parquet").to_pydict()
    assert table["index"] == [0, 1, 2]
    assert table["prediction"] == [0, 2, 1]
    assert table["label"] == ["cat", "eel", "dog"]
    assert table["target"] == [0, 2, 0]
    expected = torch.softmax(logits, dim=1).max(dim=1).values.tolist()
    assert table["probability"] == pytest.approx(expected)
    assert writer.rows == 3


def test_one_logit_is_a_binary_classifier(tmp_path: Path) -> None:
    with CsvWriter(tmp_path / "p.csv", task="classification") as writer:
        writer.write(torch.tensor([[2.0], [-1.0]]))
    lines = (tmp_path / "p.csv").read_text().splitlines()
    assert lines[0] == "index,prediction,probability"
    rows = [line.split(",") for line in lines[1:]]
    assert [row[1] for row in rows] == ["1", "0"]
    assert float(rows[0][2]) == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item())
    assert float(rows[1][2]) == pytest.approx(1 - torch.sigmoid(torch.tensor(-1.0)).item())


def test_regression_rows_one_or_several_outputs(tmp_path: Path) -> None:
    with CsvWriter(tmp_path / "one.csv", task="regression") as writer:
        writer.write(torch.tensor([[1.5], [2.5]]), torch.tensor([1.0, 2.0]))
    assert (tmp_path / "one.csv").read_text().splitlines() == [
        "index,prediction,target", "0,1.5,1.0", "1,2.5,2.0",
    ]  # fmt: skip
    with CsvWriter(tmp_path / "two.csv", task="regression") as writer:
        writer.write(torch.tensor([[1.0, 2.0]]))
    assert (tmp_path / "two.csv").read_text().splitlines()[0] == "index,prediction_0,prediction_1"


def test_npy_holds_the_raw_outputs_with_or_without_a_length(tmp_path: Path) -> None:
    outputs = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    for rows, name in ((4, "known.npy"), (None, "stream.npy")):
        with NpyWriter(tmp_path / name, task="classification", rows=rows) as writer:
            writer.write(outputs[:3])
            writer.write(outputs[3:])
        array = np.load(tmp_path / name)
        assert array.dtype == np.float32 and np.array_equal(array, outputs.numpy())


def test_a_failure_leaves_no_file(tmp_path: Path) -> None:
    with (
        pytest.raises(DataError, match="write them as .npy"),
        CsvWriter(tmp_path / "p.csv", task="classification") as writer,
    ):
        writer.write(torch.zeros(2, 3))
        writer.write(torch.zeros(2, 3, 4))  # a table cannot hold [N, T, V]
    assert list(tmp_path.iterdir()) == []
    # More samples than the data's len() said: refused, and nothing left behind.
    with (
        pytest.raises(DataError, match="does not fit the array"),
        NpyWriter(tmp_path / "p.npy", task=None, rows=2) as writer,
    ):
        writer.write(torch.zeros(3, 2))
    assert list(tmp_path.iterdir()) == []


def test_unknown_suffix_names_the_formats() -> None:
    with pytest.raises(ConfigError, match=r"\.parquet, \.csv or \.npy") as error:
        open_writer("preds.xlsx")
    assert "preds.parquet" in str(error.value)
    assert open_writer("P.CSV") is CsvWriter
