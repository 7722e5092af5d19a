"""A decoded-image cache: an image folder decoded once into uint8 arrays, served a batch at a time.

Decoding a PNG or JPEG costs far more than anything a small model does with it, and an
``ImageFolder`` decodes every file again each epoch. :class:`DecodedImages` decodes each
file once — into RAM, or into an ``.npy`` file under ``data.cache_path`` that later
epochs, workers and runs map from disk — and then serves whole batches: one gather of
the batch's crop windows from the array (flipped rows read right to left), one
conversion to float, one normalization. The random crop and flip of each sample are
drawn exactly as the per-sample path draws them, from the generator of
``(seed, epoch, index)``, so a batch holds the same crops and flips the folder's own
transform would give, whichever path, worker count or resume produced it. The pixels
are bitwise those of the per-sample path unless a ``Resize`` really resizes: the cache
then holds the resized image rounded to uint8 (within 0.5/255 of the float resize).

The transform must be one the cache can replay on a batch: ``ToTensor()``, then any of
``Resize``, ``RandomCrop``, ``RandomHorizontalFlip``, ``Normalize`` in that order (what
the ``image_folder`` source builds). Any other is refused with the reason.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from stoker.data.images import ImageFolder
from stoker.data.records import BadSample
from stoker.data.transforms import (
    Compose,
    Normalize,
    RandomCrop,
    RandomHorizontalFlip,
    Resize,
    SampleSeeds,
    ToTensor,
)
from stoker.errors import ConfigError, DataError

__all__ = ["CachePlan", "DecodedImages", "cache_plan"]

_FORMAT = 1


@dataclass(frozen=True)
class CachePlan:
    """The folder's transform, split into what is cached and what is replayed per batch."""

    resize: Resize | None
    crop: tuple[int, int] | None
    padding: int
    flip: float | None  # the flip probability, when flipping
    normalize: Normalize | None


def cache_plan(transform: Any) -> CachePlan:
    """Read an ``ImageFolder`` transform as a :class:`CachePlan`.

    Raises:
        ConfigError: The transform holds a step the cache cannot replay on a batch.
    """
    steps = list(transform.transforms) if isinstance(transform, Compose) else [transform]
    if transform is None:
        steps = [ToTensor()]
    order = (ToTensor, Resize, RandomCrop, RandomHorizontalFlip, Normalize)
    found: dict[type, Any] = {}
    position = 0
    for step in steps:
        kind = type(step)
        if kind not in order or order.index(kind) < position or kind in found:
            raise ConfigError(
                f"the image cache cannot replay the transform step {step!r} on a batch; it "
                "replays ToTensor(), then Resize, RandomCrop, RandomHorizontalFlip, Normalize "
                "(each at most once, in that order).",
                hint="set data.cache=none for this transform, or build it from those steps "
                "(the image_folder source does)",
            )
        position = order.index(kind)
        found[kind] = step
    if ToTensor not in found or steps[0] is not found[ToTensor]:
        raise ConfigError(
            f"the image cache needs a transform that starts with ToTensor(); got {transform!r}.",
            hint="put ToTensor() first, or set data.cache=none",
        )
    crop = found.get(RandomCrop)
    flip = found.get(RandomHorizontalFlip)
    return CachePlan(
        resize=found.get(Resize),
        crop=crop.size if crop else None,
        padding=crop.padding if crop else 0,
        flip=flip.p if flip else None,
        normalize=found.get(Normalize),
    )


class DecodedImages(Dataset):
    """An ``ImageFolder`` decoded once; ``__getitems__`` returns one ``(images, labels)`` batch.

    Args:
        folder: The image folder, with the transform whose crop, flip and normalization
            are replayed on each batch.
        path: A folder for the ``.npy`` cache (reused while the files, mode and sizes
            are the same); None keeps the decoded images in RAM.
    """

    #: ``__getitems__`` returns one collated batch (the loader's batched fetch).
    returns_batches = True

    def __init__(self, folder: ImageFolder, *, path: str | os.PathLike[str] | None = None) -> None:
        self.folder = folder
        self.plan = cache_plan(folder.transform)
        self.targets = folder.targets
        self.cache_dir = Path(path) if path is not None else None
        self._seeds = SampleSeeds(folder.seed)
        self._labels = folder.targets.numpy()
        self.file: Path | None = None
        self.images = self._load()

    def fingerprint_paths(self) -> list[Path]:
        """The image files' folder: the run's data fingerprint is the folder's, cached or not."""
        return [self.folder.root]

    # ------------------------------------------------------------ building the cache

    def _key(self) -> str:
        from stoker.data.fingerprint import fingerprint_files  # imports this package

        plan = self.plan
        parts = [
            f"format={_FORMAT}",
            f"files={fingerprint_files(self.folder.root, num_samples=len(self.folder)).digest}",
            f"mode={self.folder.image_mode}",
            f"resize={plan.resize.size if plan.resize else None}",
            f"padding={plan.padding}",
        ]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]

    def _load(self) -> np.ndarray:
        if self.cache_dir is None:
            return self._decode_all()
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.file = self.cache_dir / f"images-{self._key()}.npy"
        if not self.file.exists():
            images = self._decode_all()
            # Written to a temporary name, then renamed: a reader never sees half a file.
            handle, temporary = tempfile.mkstemp(dir=self.cache_dir, suffix=".npy.part")
            with os.fdopen(handle, "wb") as out:
                np.save(out, images)
            os.replace(temporary, self.file)
        return np.load(self.file, mmap_mode="r")

    def _decode_all(self) -> np.ndarray:
        """Every image, decoded and resized as the transform would, padded, as N×H×W×C uint8."""
        first = self._decoded(0)
        images = np.zeros((len(self.folder), *first.shape), dtype=np.uint8)
        images[0] = first
        for index in range(1, len(self.folder)):
            image = self._decoded(index)
            if image.shape != first.shape:
                raise DataError(
                    f"image cache: {self.folder.samples[index][0]} decodes to "
                    f"{image.shape[1]}×{image.shape[0]} but the first image to "
                    f"{first.shape[1]}×{first.shape[0]}; cached images share one size.",
                    hint="resize them to one size (image_folder's size: N), or set data.cache=none",
                )
            images[index] = image
        return images

    def _decoded(self, index: int) -> np.ndarray:
        """One image as H×W×C uint8, resized and zero-padded as the transform does."""
        decoded = self.folder.decode(index)
        if isinstance(decoded, BadSample):
            raise DataError(
                f"image cache: {decoded.source} cannot be decoded ({decoded.reason}).",
                hint="fix or remove the file, or set data.cache=none (and data.bad_records=skip)",
            )
        pixels = np.asarray(decoded)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        resize = self.plan.resize
        if resize is not None:
            tensor = resize(ToTensor()(decoded))
            if tuple(tensor.shape[-2:]) != pixels.shape[:2]:  # resized: round to uint8
                tensor = tensor.mul(255.0).round_().clamp_(0, 255).to(torch.uint8)
                pixels = tensor.permute(1, 2, 0).numpy()
        pad = self.plan.padding
        if pad:
            pixels = np.pad(pixels, ((pad, pad), (pad, pad), (0, 0)))
        return pixels

    # ------------------------------------------------------------ serving batches

    @property
    def epoch(self) -> int:
        """The epoch whose crops and flips are served."""
        return self.folder.epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the crops and flips of ``epoch`` (``EpochLoader`` calls this)."""
        self.folder.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        images, labels = self.__getitems__([index % len(self)])
        return images[0], int(labels[0])

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of ``indices``: cropped, flipped, float C×H×W, normalized; and labels."""
        idx = np.asarray(indices, dtype=np.int64)
        plan, images = self.plan, self.images
        height, width = images.shape[1:3]
        crop_h, crop_w = plan.crop or (height, width)
        free_w = width - crop_w
        windows = (height - crop_h + 1) * (free_w + 1)
        tops = np.zeros(len(idx), dtype=np.int64)
        lefts = np.zeros(len(idx), dtype=np.int64)
        flips = np.zeros(len(idx), dtype=bool)
        if plan.crop is not None or plan.flip is not None:
            epoch, seeds = self.folder.epoch, self._seeds
            for row, index in enumerate(idx.tolist()):
                # The draws of RandomCrop, then RandomHorizontalFlip, in their order.
                generator = seeds.generator(epoch, index)
                if plan.crop is not None:
                    tops[row], lefts[row] = divmod(
                        int(torch.randint(windows, (), generator=generator)), free_w + 1
                    )
                if plan.flip is not None:
                    flips[row] = float(torch.rand((), generator=generator)) < plan.flip
        rows = tops[:, None] + np.arange(crop_h)
        cols = lefts[:, None] + np.arange(crop_w)
        cols[flips] = cols[flips, ::-1]
        # One gather of every sample's window: B × h × w × C.
        pixels = images[idx[:, None, None], rows[:, :, None], cols[:, None, :]]
        batch = torch.from_numpy(pixels.transpose(0, 3, 1, 2).astype(np.float32, order="C"))
        batch.div_(255.0)
        if plan.normalize is not None:
            batch = plan.normalize(batch)
        return batch, torch.from_numpy(self._labels[idx])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        if self.file is not None:
            state["images"] = None  # a worker maps the file itself rather than a pickled copy
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.images is None and self.file is not None:
            self.images = np.load(self.file, mmap_mode="r")

    def __repr__(self) -> str:
        where = str(self.file) if self.file is not None else "memory"
        shape = "×".join(map(str, self.images.shape))
        return f"DecodedImages({self.folder!r}, {shape} uint8 in {where})"
