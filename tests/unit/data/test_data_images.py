"""Tests for stoker.data.images: ImageFolder classes, decoding, transforms and errors."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stoker.data import build_loader
from stoker.data.images import ImageFolder
from stoker.data.records import BadRecordError, BadSample
from stoker.data.transforms import Compose, RandomCrop, RandomHorizontalFlip, ToTensor
from stoker.errors import ConfigError, DataError


def write_image(path: Path, value: int, *, size: tuple[int, int] = (6, 4), mode: str = "RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.full((size[1], size[0], 3), value, dtype=np.uint8)
    pixels[0, 0] = [value, 255 - value, 7]
    Image.fromarray(pixels).convert(mode).save(path)


def make_folder(root: Path) -> Path:
    write_image(root / "dog" / "b.png", 10)
    write_image(root / "cat" / "a.png", 20)
    write_image(root / "cat" / "sub" / "c.PNG", 30, mode="L")  # grayscale, nested, upper case
    write_image(root / "dog" / "a.bmp", 40)
    (root / "dog" / "notes.txt").write_text("not an image")
    (root / ".hidden").mkdir()
    return root


def test_classes_targets_and_shapes(tmp_path: Path) -> None:
    ds = ImageFolder(make_folder(tmp_path / "train"))
    assert ds.classes == ["cat", "dog"] and ds.class_to_idx == {"cat": 0, "dog": 1}
    assert len(ds) == 4 and ds.targets.tolist() == [0, 0, 1, 1]
    assert [Path(p).name for p, _ in ds.samples] == ["a.png", "c.PNG", "a.bmp", "b.png"]
    image, target = ds[0]
    assert image.shape == (3, 4, 6) and image.dtype == torch.float32 and int(target) == 0
    assert image[:, 0, 0].tolist() == pytest.approx([20 / 255, 235 / 255, 7 / 255])
    assert float(image[0, 1, 1]) == pytest.approx(20 / 255)
    gray, _ = ds[1]  # decoded to RGB: three equal channels
    assert gray.shape == (3, 4, 6) and torch.equal(gray[0], gray[2])
    assert torch.equal(ds[-1][0], ds[3][0])


def test_transform_gets_the_image_and_a_reproducible_generator(tmp_path: Path) -> None:
    transform = Compose([ToTensor(), RandomCrop(3), RandomHorizontalFlip()])
    ds = ImageFolder(make_folder(tmp_path / "train"), transform=transform, seed=5)
    first = ds[2][0]
    assert first.shape == (3, 3, 3) and torch.equal(ds[2][0], first)
    crops = set()
    for epoch in range(6):
        ds.set_epoch(epoch)
        crops.add(tuple(ds[2][0].flatten().tolist()))
    assert ds.epoch == 5 and len(crops) > 1
    seen = []
    plain = ImageFolder(tmp_path / "train", transform=lambda image: seen.append(image.mode) or 1)
    assert plain[0][0] == 1 and seen == ["RGB"]


def test_corrupt_file_is_a_bad_record_naming_the_file(tmp_path: Path) -> None:
    root = make_folder(tmp_path / "train")
    corrupt = root / "cat" / "broken.png"
    corrupt.write_bytes(np.random.default_rng(0).integers(0, 256, 200, dtype=np.uint8).tobytes())
    ds = ImageFolder(root)
    index = [Path(p).name for p, _ in ds.samples].index("broken.png")
    with pytest.raises(BadRecordError) as caught:
        ds[index]
    assert str(corrupt) in str(caught.value) and f"index {index}" in str(caught.value)
    assert "cannot decode image" in caught.value.sample.reason
    bad = ImageFolder(root, bad_records="skip")[index]
    assert isinstance(bad, BadSample) and bad.source == str(corrupt)
    loader = build_loader(ImageFolder(root, bad_records="skip"), batch_size=8)
    ((images, targets),) = list(loader)
    assert images.shape == (4, 3, 4, 6) and targets.tolist() == [0, 0, 1, 1]
    assert loader.bad_records.total == 1


def test_truncated_image_is_bad(tmp_path: Path) -> None:
    root = make_folder(tmp_path / "train")
    write_image(root / "dog" / "big.png", 90, size=(64, 64))
    big = root / "dog" / "big.png"
    big.write_bytes(big.read_bytes()[:60])
    ds = ImageFolder(root, bad_records="skip")
    assert isinstance(ds[[Path(p).name for p, _ in ds.samples].index("big.png")], BadSample)


def test_folder_errors_name_the_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        ImageFolder(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no class sub-folders"):
        ImageFolder(tmp_path / "empty")
    root = make_folder(tmp_path / "train")
    (root / "bird").mkdir()
    (root / "bird" / "readme.txt").write_text("-")
    with pytest.raises(DataError, match=r"class folder .*bird"):
        ImageFolder(root)
    with pytest.raises(ConfigError, match="bad_records"):
        ImageFolder(root, bad_records="ignore")  # type: ignore[arg-type]


def test_missing_pillow_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(ConfigError) as caught:
        ImageFolder(tmp_path)
    assert "pip install 'stoker[images]'" in str(caught.value)
