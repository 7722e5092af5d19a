"""Tests for stoker.data.transforms: each transform, and augmentation that repeats exactly."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from stoker.data import ArrayDataset, build_loader
from stoker.data.transforms import (
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    RandomNoise,
    ReproducibleTransformDataset,
    Resize,
    SharedEpoch,
    ToTensor,
    as_transform,
    sample_generator,
)
from stoker.errors import ConfigError, DataError

AUGMENT = Compose([RandomCrop(6, padding=2), RandomHorizontalFlip(), RandomNoise(0.1)])


def images(n: int = 12) -> ArrayDataset:
    pixels = torch.arange(n * 3 * 8 * 8, dtype=torch.float32).reshape(n, 3, 8, 8) / 1000
    return ArrayDataset(pixels, torch.arange(n))


def test_sample_generator_depends_on_seed_epoch_and_index_only() -> None:
    def draw(seed: int, epoch: int, index: int) -> list[float]:
        return torch.rand(4, generator=sample_generator(seed, epoch, index)).tolist()

    assert draw(1, 2, 3) == draw(1, 2, 3)
    others = [draw(1, 2, 4), draw(1, 3, 3), draw(2, 2, 3), draw(1, 3, 2), draw(2, 1, 3)]
    assert all(other != draw(1, 2, 3) for other in others)
    assert len({tuple(d) for d in others}) == len(others)


def test_same_sample_same_augmentation_other_epochs_differ() -> None:
    image = images()[5][0]
    first = AUGMENT(image, generator=sample_generator(0, 0, 5))
    again = AUGMENT(image, generator=sample_generator(0, 0, 5))
    later = AUGMENT(image, generator=sample_generator(0, 1, 5))
    assert first.shape == (3, 6, 6)
    assert torch.equal(first, again) and not torch.equal(first, later)


def test_to_tensor_normalize_resize() -> None:
    array = np.zeros((4, 6, 3), dtype=np.uint8)
    array[0, 0] = [255, 0, 51]
    tensor = ToTensor()(Image.fromarray(array))
    assert tensor.shape == (3, 4, 6) and tensor.dtype == torch.float32
    assert tensor[:, 0, 0].tolist() == pytest.approx([1.0, 0.0, 0.2])
    gray = ToTensor()(Image.fromarray(np.full((2, 3), 255, dtype=np.uint8)))
    assert gray.shape == (1, 2, 3) and float(gray.max()) == 1.0
    normal = Normalize([0.5, 0.0, 0.0], [0.5, 1.0, 2.0])(tensor)
    assert normal[:, 0, 0].tolist() == pytest.approx([1.0, 0.0, 0.1])
    assert Resize(2)(tensor).shape == (3, 2, 3)  # shorter side 2, aspect kept
    assert Resize((5, 7))(tensor).shape == (3, 5, 7)
    assert Resize(8)(Image.fromarray(array)).size == (12, 8)  # Pillow: (width, height)
    with pytest.raises(DataError, match="3 channels"):
        Normalize([0.5, 0.5], [1.0, 1.0])(tensor)
    with pytest.raises(ConfigError, match="positive std"):
        Normalize([0.5], [0.0])


def test_random_crop_flip_noise_values() -> None:
    image = torch.arange(16.0).reshape(1, 4, 4)
    crop = RandomCrop(2)(image, generator=sample_generator(0, 0, 0))
    top, left = divmod(int(crop[0, 0, 0]), 4)
    assert torch.equal(crop, image[:, top : top + 2, left : left + 2])
    padded = RandomCrop(4, padding=1)(image, generator=sample_generator(0, 0, 1))
    assert padded.shape == (1, 4, 4) and set(padded.unique().tolist()) <= set(range(16))
    assert torch.equal(
        RandomHorizontalFlip(p=1.0)(image, generator=torch.Generator()), image.flip(-1)
    )
    assert torch.equal(RandomHorizontalFlip(p=0.0)(image, generator=torch.Generator()), image)
    noisy = RandomNoise(0.5)(torch.zeros(10_000), generator=sample_generator(0, 0, 0))
    assert float(noisy.std()) == pytest.approx(0.5, rel=0.05)
    with pytest.raises(ConfigError, match="needs an explicit generator"):
        RandomHorizontalFlip()(image)
    with pytest.raises(DataError, match="put ToTensor"):
        RandomCrop(2)(Image.new("RGB", (4, 4)), generator=torch.Generator())
    with pytest.raises(DataError, match="larger than"):
        RandomCrop(5)(image, generator=torch.Generator())


def test_plain_callables_are_seeded_per_sample() -> None:
    def jitter(x: torch.Tensor) -> torch.Tensor:  # draws from the global RNG
        return x + torch.rand(x.shape)

    transform = as_transform(jitter)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = transform(torch.zeros(3), generator=sample_generator(0, 0, 1))
    assert torch.equal(torch.get_rng_state(), before)  # the global stream is left alone
    assert torch.equal(
        first, Compose([jitter])(torch.zeros(3), generator=sample_generator(0, 0, 1))
    )
    assert not torch.equal(first, transform(torch.zeros(3), generator=sample_generator(0, 0, 2)))
    with pytest.raises(ConfigError, match="not callable"):
        as_transform(3)  # type: ignore[arg-type]


def test_reproducible_dataset_epochs_and_fields() -> None:
    ds = ReproducibleTransformDataset(images(), AUGMENT, seed=7)
    x, y = ds[3]
    assert x.shape == (3, 6, 6) and int(y) == 3
    assert torch.equal(ds[3][0], x)
    ds.set_epoch(1)
    assert ds.epoch == 1 and not torch.equal(ds[3][0], x)
    ds.set_epoch(0)
    assert torch.equal(ds[3][0], x)
    assert ds.targets.tolist() == list(range(12))
    copy = pickle.loads(pickle.dumps(ds))
    assert torch.equal(copy[3][0], x)


def test_shared_epoch_reaches_copies_in_shared_memory() -> None:
    epoch = SharedEpoch(3)
    assert epoch.value == 3 and epoch._value.is_shared()
    epoch.value = 5
    assert epoch.value == 5


def epoch_batches(loader, epochs: int = 2) -> list[list[torch.Tensor]]:
    return [[x.clone() for x, _ in loader] for _ in range(epochs)]


def test_augmentation_identical_across_worker_counts() -> None:
    def loader(num_workers: int, persistent: bool = False):
        ds = ReproducibleTransformDataset(images(), AUGMENT, seed=3)
        return build_loader(
            ds,
            batch_size=4,
            shuffle=True,
            seed=3,
            num_workers=num_workers,
            persistent_workers=persistent,
        )

    main = epoch_batches(loader(0))
    assert not torch.equal(torch.cat(main[0]), torch.cat(main[1]))  # epochs differ
    for workers in (epoch_batches(loader(2)), epoch_batches(loader(2, persistent=True))):
        assert all(
            torch.equal(a, b)
            for ea, eb in zip(main, workers, strict=True)
            for a, b in zip(ea, eb, strict=True)
        )


def test_sample_seeds_give_sample_generator_states_for_any_epoch_order() -> None:
    import pickle

    from stoker.data.transforms import SampleSeeds

    seeds = SampleSeeds(7)
    for epoch, index in [(0, 0), (0, 5), (3, 5), (0, 2**40), (3, 1)]:
        expected = torch.rand(3, generator=sample_generator(7, epoch, index))
        assert torch.equal(torch.rand(3, generator=seeds.generator(epoch, index)), expected)
    copy = pickle.loads(pickle.dumps(seeds))  # to a worker process: no generator travels
    assert torch.equal(
        torch.rand(3, generator=copy.generator(2, 9)),
        torch.rand(3, generator=sample_generator(7, 2, 9)),
    )


def test_random_crop_reaches_every_window_with_one_draw() -> None:
    image = torch.arange(16.0).reshape(1, 4, 4)
    corners = {
        tuple(RandomCrop(2)(image, generator=sample_generator(0, 0, i))[0, 0].tolist())
        for i in range(200)
    }
    assert len(corners) == 9  # all 3 x 3 positions of a 2x2 window in 4x4


def test_to_tensor_matches_a_plain_conversion_bit_for_bit() -> None:
    import numpy as np
    from PIL import Image

    from stoker.data.transforms import ToTensor

    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    out = ToTensor()(Image.fromarray(pixels))
    expected = torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 255.0
    assert out.is_contiguous() and torch.equal(out, expected)
    gray = ToTensor()(np.array([[0, 65535]], dtype=np.uint16))
    assert gray.shape == (1, 1, 2) and gray.tolist() == [[[0.0, 1.0]]]
