"""Tests for stoker.data.images: ImageFolder classes, decoding, transforms and errors."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stoker.data import build_loader
from stoker.data.images import ImageFolder, ImageSurvey
from stoker.data.records import BadRecordError, BadSample
from stoker.data.transforms import Compose, RandomCrop, RandomHorizontalFlip, Resize, ToTensor
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
    # Only a window at the top-left corner holds the one odd pixel: 1 crop in 8.
    for epoch in range(40):
        ds.set_epoch(epoch)
        crops.add(tuple(ds[2][0].flatten().tolist()))
    assert ds.epoch == 39 and len(crops) > 1
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


def gray_folder(root: Path, *, extra: dict[str, str] | None = None) -> Path:
    """Two classes of 5×3 grayscale PNGs; ``extra`` adds {relative path: mode} files."""
    for label, value in (("a", 40), ("b", 200)):
        for i in range(2):
            write_image(root / label / f"{i}.png", value + i, size=(5, 3), mode="L")
    for name, mode in (extra or {}).items():
        write_image(root / name, 90, size=(5, 3), mode=mode)
    return root


def test_keep_keeps_one_channel_of_grayscale_files(tmp_path: Path) -> None:
    ds = ImageFolder(gray_folder(tmp_path / "gray"), mode="keep")
    assert ds.mode == "keep" and ds.image_mode == "L" and ds.channels == 1
    image, target = ds[2]
    assert image.shape == (1, 3, 5) and int(target) == 1
    assert float(image[0, 1, 1]) == pytest.approx(200 / 255)
    assert "mode L, 1 channel)" in repr(ds)
    (batch, _), *_ = build_loader(ds, batch_size=4)
    assert batch.shape == (4, 1, 3, 5)


@pytest.mark.parametrize(
    ("mode", "channels", "first_pixel"),
    [
        ("L", 1, [round(0.299 * 20 + 0.587 * 235 + 0.114 * 7) / 255]),
        ("RGB", 3, [20 / 255, 235 / 255, 7 / 255]),
        ("RGBA", 4, [20 / 255, 235 / 255, 7 / 255, 1.0]),
    ],
)
def test_a_named_mode_converts_every_file_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str, channels: int, first_pixel
) -> None:
    with caplog.at_level(logging.WARNING, logger="stoker"):
        ds = ImageFolder(make_folder(tmp_path / "train"), mode=mode)  # RGB, L and BMP files
        images = [ds[i][0] for i in range(len(ds))]
    assert ds.image_mode == mode and ds.channels == channels
    assert all(image.shape == (channels, 4, 6) for image in images)
    assert images[0][:, 0, 0].tolist() == pytest.approx(first_pixel, abs=1 / 255)
    assert caplog.records == []  # a mode the user named is no surprise


def test_default_makes_rgb_and_says_once_which_file_had_another_mode(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = gray_folder(tmp_path / "gray")
    with caplog.at_level(logging.WARNING, logger="stoker"):
        ds = ImageFolder(root)
        images = [ds[i][0] for i in range(len(ds))]
    assert ds.mode is None and ds.image_mode == "RGB" and ds.channels == 3
    assert all(image.shape == (3, 3, 5) for image in images)
    assert torch.equal(images[0][0], images[0][2])
    (note,) = caplog.records  # once, though every file was converted
    message = note.getMessage()
    assert note.levelname == "WARNING" and str(root / "a" / "0.png") in message
    assert "is L (1 channel)" in message and "converted to RGB (3 channels)" in message
    assert "mode: L (or keep)" in message and "mode: RGB" in message


def test_default_notes_a_file_of_another_mode_found_while_reading(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "photos"
    for label in ("a", "b"):
        write_image(root / label / "0.png", 30)
    write_image(root / "b" / "1.png", 60, mode="L")  # not a class's first file
    with caplog.at_level(logging.WARNING, logger="stoker"):
        ds = ImageFolder(root)
        assert caplog.records == []  # the first file of each class is RGB
        for i in range(len(ds)):
            ds[i]
        ds[2]
    (note,) = caplog.records
    assert str(root / "b" / "1.png") in note.getMessage()


def test_keep_stops_at_mixed_modes_naming_the_file_and_the_fix(tmp_path: Path) -> None:
    root = gray_folder(tmp_path / "mixed", extra={"c/0.png": "RGB"})  # a class of RGB files
    with pytest.raises(DataError) as caught:
        ImageFolder(root, mode="keep")
    message = str(caught.value)
    assert str(root / "c" / "0.png") in message and str(root / "a" / "0.png") in message
    assert "is RGB (3 channels)" in message and "is L (1 channel)" in message
    assert "mode: RGB" in message
    assert ImageFolder(root, mode="RGB")[4][0].shape == (3, 3, 5)  # the fix works

    inner = gray_folder(tmp_path / "inner", extra={"b/9.png": "RGB"})  # found while reading
    ds = ImageFolder(inner, mode="keep")
    assert ds.image_mode == "L"
    with pytest.raises(DataError, match=r"(?s)9\.png is RGB .*fix: set mode: RGB"):
        list(build_loader(ds, batch_size=8))


def test_keep_expands_palette_images_to_the_colours_they_show(tmp_path: Path) -> None:
    root = tmp_path / "palette"
    for label in ("a", "b"):
        (root / label).mkdir(parents=True)
        image = Image.new("P", (4, 2))
        image.putpalette([0, 0, 0, 250, 100, 50] + [0] * 762)
        image.putpixel((1, 0), 1)
        image.save(root / label / "0.png")
    ds = ImageFolder(root, mode="keep")
    assert ds.image_mode == "RGB" and ds.channels == 3
    assert ds[0][0][:, 0, 1].tolist() == pytest.approx([250 / 255, 100 / 255, 50 / 255])


def test_an_unknown_mode_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"mode='CMYK'.*keep, L, RGB, RGBA"):
        ImageFolder(make_folder(tmp_path / "train"), mode="CMYK")  # type: ignore[arg-type]


def test_survey_reads_sizes_and_modes_from_headers(tmp_path: Path) -> None:
    root = make_folder(tmp_path / "train")
    (root / "cat" / "broken.png").write_bytes(b"not a png")
    ds = ImageFolder(root, mode="RGB")
    survey = ImageSurvey.of(path for path, _ in ds.samples)
    assert survey.sizes == {(6, 4): 4} and survey.modes == {"RGB": 3, "L": 1}
    assert survey.unreadable == [str(root / "cat" / "broken.png")]
    assert survey.kept_modes == {"RGB": 3, "L": 1}


def test_resize_to_the_size_an_image_has_returns_it_untouched() -> None:
    tensor = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0))
    assert Resize((8, 8))(tensor) is tensor and Resize(8)(tensor) is tensor
    assert Resize((4, 8))(tensor).shape == (3, 4, 8)
    image = Image.new("L", (8, 6))
    assert Resize((6, 8))(image) is image and Resize(3)(image).size == (4, 3)
