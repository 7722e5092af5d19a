"""`stoker data inspect` read without torch prints what the torch datasets print.

The torch-free reader (stoker.cli.data_light) and the datasets must agree line for line,
fingerprint included: the digest shown is the one a run records for the same data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import stoker.cli.data_light as light
from stoker_cli import run_cli


def _data(root: Path) -> list[Path]:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(40, 3)).astype("float32")
    labels = (features[:, 0] > 0).astype(np.int64)
    csv = root / "t.csv"
    pairs = zip(features, labels, strict=True)
    lines = [",".join(f"{v:.6f}" for v in row) + f",{y}\n" for row, y in pairs]
    csv.write_text("a,b,c,label\n" + "".join(lines))
    blanks = root / "blanks.csv"
    blanks.write_text("a,b\n1,2\n\n3,4\r\n\r\n5,6")  # blank lines skipped, last without \n
    table = {"a": features[:, 0], "h": features[:, 1].astype("float16"), "flag": labels == 1}
    pq.write_table(pa.table({**table, "label": labels}), root / "t.parquet", row_group_size=7)
    (root / "pq").mkdir()
    pq.write_table(pa.table({"x": np.arange(2.0)}), root / "pq" / "a.parquet")
    pq.write_table(pa.table({"x": np.arange(3.0)}), root / "pq" / "b.parquet")
    np.save(root / "t.npy", features)
    (root / "npy").mkdir()
    np.save(root / "npy" / "features.npy", features)
    np.save(root / "npy" / "target.npy", labels)
    np.save(root / "npy" / "aux.npy", np.arange(40, dtype=np.int32).reshape(40, 1, 1))
    return [csv, blanks, root / "t.parquet", root / "pq", root / "t.npy", root / "npy"]


def test_the_torch_free_reader_prints_what_the_datasets_print(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for path in _data(tmp_path):
        suffixes = {p.suffix for p in path.rglob("*")} if path.is_dir() else set()
        assert light.open_light(path, 3, suffixes) is not None, path  # the light path is taken
        for rows in ("2", "9"):
            args = ("data", "inspect", str(path), "--rows", rows)
            fast = run_cli(*args)
            with monkeypatch.context() as patch:
                patch.setattr(light, "open_light", lambda *_: None)
                slow = run_cli(*args)
            assert fast.returncode == slow.returncode == 0, (fast.stderr, slow.stderr)
            assert fast.stdout == slow.stdout, path


def test_a_bad_row_among_those_shown_is_left_to_the_dataset(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,x\n")
    assert light.open_light(bad, 3, set()) is None
    done = run_cli("data", "inspect", str(bad))
    assert done.returncode != 0 and "line 2: column 'b' value 'x' is not a number" in done.stderr
