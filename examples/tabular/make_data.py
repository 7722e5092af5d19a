"""Write the tabular examples' data files from data that scikit-learn ships (no download).

    python examples/tabular/make_data.py

writes, beside this script:

- ``diabetes.csv``: scikit-learn's diabetes regression set (442 patients, 10 standardised
  features, the target a disease-progression score from 25 to 346 written as an
  integer, as the original data has it);
- ``breast_cancer.parquet``: the Wisconsin breast-cancer set (569 tumours, 30 float32
  features on their raw scales, ``label`` 1 for benign, 0 for malignant: 357 against
  212), one row group per 128 rows.

Both files are committed; the script is here to show where they come from and to
rebuild them. The output is the same on every run.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def write_diabetes_csv(path: Path) -> None:
    """The diabetes set as CSV: features ``age … s6`` with 6 decimals, then ``target``."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes()
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow([*data.feature_names, "target"])
        for features, target in zip(data.data, data.target, strict=True):
            writer.writerow([*(f"{value:.6f}" for value in features), int(target)])


def write_breast_cancer_parquet(path: Path) -> None:
    """The breast-cancer set as Parquet: 30 float32 columns and an int64 ``label``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    columns = {
        name.replace(" ", "_"): pa.array(data.data[:, i].astype(np.float32))
        for i, name in enumerate(data.feature_names)
    }
    columns["label"] = pa.array(data.target.astype(np.int64))
    pq.write_table(pa.table(columns), path, row_group_size=128)


if __name__ == "__main__":
    write_diabetes_csv(HERE / "diabetes.csv")
    write_breast_cancer_parquet(HERE / "breast_cancer.parquet")
    print(f"wrote {HERE / 'diabetes.csv'} and {HERE / 'breast_cancer.parquet'}")
