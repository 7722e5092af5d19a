"""ImageFolder: a map-style dataset of image files, one sub-folder per class."""

from __future__ import annotations

import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import Dataset

from stoker.data.records import BadRecordPolicy, BadSample, bad_record
from stoker.data.transforms import SharedEpoch, ToTensor, as_transform, sample_generator
from stoker.errors import ConfigError, DataError

__all__ = ["IMAGE_EXTENSIONS", "ImageFolder"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def _pillow() -> ModuleType:
    """Pillow's ``Image`` module, imported on first use (an optional dependency)."""
    try:
        from PIL import Image
    except ImportError as error:
        raise ConfigError(
            "reading image files needs Pillow, which is not installed.",
            hint="pip install 'stoker[images]'",
        ) from error
    return Image


def _image_files(folder: Path, extensions: tuple[str, ...]) -> list[str]:
    """Image files under ``folder`` (recursively, following links), in sorted order."""
    found = []
    for directory, subdirs, files in os.walk(folder, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        found.extend(
            os.path.join(directory, name)
            for name in sorted(files)
            if not name.startswith(".") and name.lower().endswith(extensions)
        )
    return found


class ImageFolder(Dataset):
    """Images stored as ``root/<class name>/<file>``; samples are ``(image, class id)``.

    Class names are the sub-folders of ``root`` in sorted order, numbered from 0.
    Images are decoded to RGB with Pillow. Without a ``transform`` each image becomes a
    float32 C×H×W tensor in [0, 1]; a transform receives the Pillow image and the
    generator of :func:`~stoker.data.transforms.sample_generator` for
    ``(seed, epoch, index)``, so augmentation is reproducible with any number of workers.

    Example:
        >>> ds = ImageFolder("data/train", transform=Compose([
        ...     Resize(36), ToTensor(), RandomCrop(32), RandomHorizontalFlip()]))
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        transform: Callable[..., Any] | None = None,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
        bad_records: BadRecordPolicy = "error",
        seed: int = 0,
    ) -> None:
        """Scan ``root`` for classes and image files (the files are read later, per sample).

        Args:
            root: The folder that holds one sub-folder per class.
            transform: Applied to each Pillow image; a stoker transform, a ``Compose``,
                or any one-argument callable (e.g. a torchvision transform).
            extensions: File name endings that count as images (case-insensitive).
            bad_records: ``error`` raises on an unreadable image; ``skip`` hands it to
                the loader, which drops and logs it.
            seed: The run's seed, mixed with the epoch and index for augmentation.

        Raises:
            ConfigError: Pillow is missing, or ``bad_records`` is not error/skip.
            DataError: ``root`` is missing, has no class folders, or a class folder
                holds no images.
        """
        _pillow()  # fail now, not in a worker, when Pillow is missing
        if bad_records not in ("error", "skip"):
            raise ConfigError(
                f"bad_records={bad_records!r}; expected error or skip.",
                hint="set data.bad_records=error (stop) or skip (drop and log)",
            )
        self.root = Path(root)
        self.extensions = tuple(e.lower() for e in extensions)
        self.bad_records: BadRecordPolicy = bad_records
        self.seed = int(seed)
        self.transform = transform
        self._transform = ToTensor() if transform is None else as_transform(transform)
        self._epoch = SharedEpoch()
        self.classes, self.samples = self._scan()
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.targets = torch.tensor([target for _, target in self.samples], dtype=torch.long)

    def _scan(self) -> tuple[list[str], list[tuple[str, int]]]:
        if not self.root.is_dir():
            raise DataError(
                f"image folder {str(self.root)!r} does not exist or is not a folder.",
                hint="check the data path; ImageFolder expects root/<class name>/<image file>",
            )
        classes = sorted(
            entry.name
            for entry in os.scandir(self.root)
            if entry.is_dir() and not entry.name.startswith(".")
        )
        if not classes:
            raise DataError(
                f"image folder {str(self.root)!r} has no class sub-folders; expected one "
                "sub-folder per class, each holding that class's images.",
                hint=f"arrange the files as {self.root}/<class name>/<image file>",
            )
        samples: list[tuple[str, int]] = []
        for target, name in enumerate(classes):
            files = _image_files(self.root / name, self.extensions)
            if not files:
                raise DataError(
                    f"class folder {str(self.root / name)!r} holds no images with the "
                    f"endings {', '.join(self.extensions)}.",
                    hint="add its images, remove the folder, or pass extensions=(...) "
                    "with the endings your files use",
                )
            samples.extend((path, target) for path in files)
        return classes, samples

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentations of ``epoch`` (``EpochLoader`` calls this)."""
        self._epoch.value = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, torch.Tensor] | BadSample:
        i = operator.index(index)
        path, target = self.samples[i]
        i %= len(self.samples)  # ds[-1] is ds[n - 1], augmentation included
        image_module = _pillow()
        try:
            with image_module.open(path) as image:
                # convert() decodes the whole file, so a truncated image fails here.
                rgb = image.convert("RGB")
        except (OSError, ValueError, SyntaxError, image_module.DecompressionBombError) as error:
            return bad_record(
                self.bad_records,
                source=path,
                location=f"index {i}",
                reason=f"cannot decode image: {type(error).__name__}: {error}",
            )
        generator = None if self.transform is None else sample_generator(self.seed, self.epoch, i)
        return self._transform(rgb, generator=generator), torch.tensor(target)

    def __repr__(self) -> str:
        return (
            f"ImageFolder({str(self.root)!r}: {len(self.samples)} images, "
            f"{len(self.classes)} classes)"
        )
