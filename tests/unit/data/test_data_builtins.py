"""The config-named sources build working datasets from YAML-friendly arguments."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from stoker.data.builtins import SOURCES, image_folder


def test_every_source_has_a_name() -> None:
    assert sorted(SOURCES) == ["csv", "image_folder", "jsonl", "npy", "parquet", "shards"]


@pytest.mark.parametrize("augment", [False, True])
def test_image_folder_resizes_and_augments(tmp_path, augment: bool) -> None:
    for label in ("cat", "dog"):
        (tmp_path / label).mkdir()
        for i in range(2):
            Image.new("RGB", (12, 10), (i * 90, 20, 200)).save(tmp_path / label / f"{i}.png")
    dataset = image_folder(str(tmp_path), size=8, augment=augment, mean=[0.5] * 3, std=[0.5] * 3)
    image, label = dataset[3]
    assert image.shape == (3, 8, 8) and image.dtype == torch.float32
    assert int(label) == 1
    assert float(image.min()) >= -1.0 - 1e-6 and float(image.max()) <= 1.0 + 1e-6


@pytest.mark.parametrize(("limit", "expected"), [(64, 64 << 20), (None, None)])
def test_npy_source_passes_the_mapping_budget_through(tmp_path, limit, expected) -> None:
    import numpy as np

    from stoker.data.builtins import npy

    np.save(tmp_path / "x.npy", np.arange(12, dtype=np.float32).reshape(6, 2))
    np.save(tmp_path / "label.npy", np.arange(6))
    dataset = npy(str(tmp_path), mmap=True, max_mapped_mib=limit)
    assert dataset._max_mapped == expected
    features, label = dataset.__getitems__([5, 0])
    assert features.tolist() == [[10.0, 11.0], [0.0, 1.0]] and label.tolist() == [5, 0]
