"""`stoker data convert` and `stoker data inspect`, and configs pointing at each source."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stoker_cli import run_cli


def stoker(*args: str) -> subprocess.CompletedProcess[str]:
    """The user's path: a fresh ``python -m stoker`` (one per subcommand is enough)."""
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli.main", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture
def csv_file(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(300, 4)).astype("float32")
    labels = (features[:, 0] > 0).astype(int)
    path = tmp_path / "table.csv"
    lines = ["a,b,c,d,label"] + [
        ",".join(f"{v:.6f}" for v in row) + f",{label}"
        for row, label in zip(features, labels, strict=True)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_convert_then_inspect_parquet_and_npy(tmp_path: Path, csv_file: Path) -> None:
    done = stoker(
        "data",
        "convert",
        str(csv_file),
        str(tmp_path / "t.parquet"),
        "--to",
        "parquet",
        "--target",
        "label",
    )
    assert done.returncode == 0, done.stderr
    assert "300 rows written, 0 skipped" in done.stdout
    shown = stoker("data", "inspect", str(tmp_path / "t.parquet"))
    assert shown.returncode == 0, shown.stderr
    assert "samples:     300" in shown.stdout and "label: int64" in shown.stdout
    assert "fingerprint:" in shown.stdout and "[0]" in shown.stdout

    # The same two subcommands in-process: the subprocess above already took the user's path.
    done = run_cli(
        "data", "convert", str(csv_file), str(tmp_path / "npy"), "--to", "npy", "--target", "label"
    )
    assert done.returncode == 0, done.stderr
    shown = run_cli("data", "inspect", str(tmp_path / "npy"))
    assert "features: float32 [4] per sample" in shown.stdout
    assert "target: int64 [] per sample" in shown.stdout


def test_inspect_an_image_folder(tmp_path: Path) -> None:
    for label in ("cat", "dog"):
        (tmp_path / "img" / label).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (8, 8), color=(i * 40, 10, 200)).save(
                tmp_path / "img" / label / f"{i}.png"
            )
    shown = run_cli("data", "inspect", str(tmp_path / "img"))
    assert shown.returncode == 0, shown.stderr
    assert "(image folder)" in shown.stdout and "cat: 3 images" in shown.stdout


def test_inspect_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    done = run_cli("data", "inspect", str(tmp_path / "nothing.parquet"))
    assert done.returncode == 1 and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("source", ["csv", "parquet", "npy"])
def test_a_config_can_point_at_each_file_source(tmp_path: Path, csv_file: Path, source) -> None:
    if source == "csv":
        args = {"path": str(csv_file), "target": "label"}
    else:
        out = tmp_path / ("t.parquet" if source == "parquet" else "npy")
        run_cli("data", "convert", str(csv_file), str(out), "--to", source, "--target", "label")
        args = {"path": str(out), "target": "label"} if source == "parquet" else {"path": str(out)}
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name": "mlp", "args": {"in_features": 4, "out_features": 2, "hidden": [8]}},
        "data": {"train": {"name": source, "args": args}, "val_fraction": 0.2},
        "train": {"epochs": 2}, "tracking": {"tensorboard": False},
    }))  # fmt: skip
    done = run_cli("train", str(config), "--run-dir", str(tmp_path / "run"), "--quiet")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["epoch"] for r in records if "val/loss" in r] == [1, 2]
    fingerprint = json.loads((tmp_path / "run" / "data_fingerprint.json").read_text())
    assert fingerprint["kind"] in ("files", "arrays")


def test_skipped_bad_rows_are_logged_in_the_run_dir(tmp_path: Path, csv_file: Path) -> None:
    lines = csv_file.read_text().splitlines()
    lines[5] = "1.0,oops,2.0,3.0,1"  # line 6 of the file
    csv_file.write_text("\n".join(lines) + "\n")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name": "mlp", "args": {"in_features": 4, "out_features": 2, "hidden": [8]}},
        "data": {"train": {"name": "csv", "args": {"path": str(csv_file), "target": "label"}},
                 "bad_records": "skip"},
        "train": {"epochs": 1}, "tracking": {"tensorboard": False},
    }))  # fmt: skip
    done = run_cli("train", str(config), "--run-dir", str(tmp_path / "run"), "--quiet")
    assert done.returncode == 0, done.stderr
    bad = [json.loads(line) for line in (tmp_path / "run" / "bad_records.jsonl").open()]
    assert len(bad) == 1 and bad[0]["location"] == "line 6" and "oops" in bad[0]["reason"]

    strict = run_cli(
        "train", str(config), "data.bad_records=error", "--run-dir", str(tmp_path / "run2")
    )
    assert strict.returncode == 1
    assert "line 6" in strict.stderr and "data.bad_records=skip" in strict.stderr
