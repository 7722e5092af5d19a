"""DecodedImages: an image folder decoded once, served by batches with the folder's own
seeded crops and flips."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from stoker.data.fingerprint import fingerprint_dataset
from stoker.data.image_cache import DecodedImages, cache_plan
from stoker.data.images import ImageFolder
from stoker.data.transforms import (
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomNoise,
    Resize,
    ToTensor,
)
from stoker.errors import ConfigError, DataError

AUGMENT = Compose(
    [ToTensor(), RandomCrop(8, padding=2), RandomHorizontalFlip(), Normalize([0.5] * 3, [0.2] * 3)]
)


def _folder(root: Path, count: int = 12, size: tuple[int, int] = (12, 10)) -> Path:
    rng = np.random.default_rng(0)
    for i in range(count):
        path = root / ("a" if i % 3 else "b") / f"{i}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return root


@pytest.mark.parametrize("on_disk", [False, True])
def test_batches_equal_the_per_sample_path_in_every_epoch(tmp_path, on_disk) -> None:
    folder = ImageFolder(_folder(tmp_path / "images"), transform=AUGMENT, seed=3)
    cached = DecodedImages(folder, path=tmp_path / "cache" if on_disk else None)
    indices = [5, 0, 11, 3, 3]
    for epoch in (0, 1, 7):
        cached.set_epoch(epoch)
        images, labels = cached.__getitems__(indices)
        assert images.shape == (5, 3, 8, 8) and labels.dtype == torch.long
        expected = torch.stack([folder[i][0] for i in indices])
        assert torch.equal(images, expected), epoch
        assert labels.tolist() == [folder[i][1] for i in indices]
    if on_disk:
        (file,) = (tmp_path / "cache").glob("images-*.npy")
        again = DecodedImages(folder, path=tmp_path / "cache")  # read back, not decoded
        assert again.file == file and isinstance(again.images, np.memmap)
    # The run's data fingerprint is the image files', not the cache's.
    assert fingerprint_dataset(cached) == fingerprint_dataset(folder)


def test_a_real_resize_is_cached_as_rounded_uint8(tmp_path) -> None:
    transform = Compose([ToTensor(), Resize((6, 6)), RandomHorizontalFlip()])
    folder = ImageFolder(_folder(tmp_path / "images"), transform=transform, seed=1)
    images, _ = DecodedImages(folder).__getitems__(list(range(12)))
    expected = torch.stack([folder[i][0] for i in range(12)])
    assert images.shape == (12, 3, 6, 6)
    assert float((images - expected).abs().max()) <= 0.5 / 255 + 1e-6


def test_transforms_it_cannot_replay_are_refused_with_the_step_named() -> None:
    with pytest.raises(ConfigError, match="RandomNoise"):
        cache_plan(Compose([ToTensor(), RandomNoise(0.1)]))
    with pytest.raises(ConfigError, match="order"):
        cache_plan(Compose([ToTensor(), RandomHorizontalFlip(), RandomCrop(4)]))
    assert cache_plan(None).crop is None


def test_images_of_different_sizes_are_refused(tmp_path) -> None:
    root = _folder(tmp_path / "images", count=3)
    Image.new("RGB", (5, 5)).save(root / "a" / "odd.png")
    with pytest.raises(DataError, match="one size"):
        DecodedImages(ImageFolder(root, transform=Compose([ToTensor()])))


def test_fit_with_the_image_cache_trains_the_same_weights(tmp_path) -> None:
    import stoker

    root = _folder(tmp_path / "images", count=24)

    def run(cache: str) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 2))
        stoker.fit(
            model,
            ImageFolder(root, transform=AUGMENT, seed=0),
            epochs=2,
            batch_size=8,
            cache=cache,
            threads=1,
            progress="quiet",
            tensorboard=False,
            run_dir=tmp_path / f"run-{cache}",
        )
        return model

    plain, cached = run("none"), run("memory")
    for p, q in zip(plain.parameters(), cached.parameters(), strict=True):
        assert torch.equal(p, q)
