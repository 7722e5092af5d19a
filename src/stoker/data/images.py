"""ImageFolder: a map-style dataset of image files, one sub-folder per class."""

from __future__ import annotations

import logging
import operator
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal, get_args

import torch
from torch.utils.data import Dataset

from stoker.data.records import BadRecordPolicy, BadSample, bad_record
from stoker.data.transforms import SampleSeeds, SharedEpoch, ToTensor, as_transform
from stoker.errors import ConfigError, DataError

__all__ = ["IMAGE_EXTENSIONS", "IMAGE_MODES", "ImageFolder", "ImageMode", "ImageSurvey"]

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")

#: ``keep``: each file's own mode; ``L``, ``RGB``, ``RGBA``: Pillow's modes of 1, 3, 4 channels.
ImageMode = Literal["keep", "L", "RGB", "RGBA"]
IMAGE_MODES: tuple[str, ...] = get_args(ImageMode)

# Modes whose pixel values are not what the image shows: a palette image holds indices
# into its palette, a 1-bit image packs bits. "keep" expands them to the pixels they show.
_EXPANDED = {"P": "RGB", "PA": "RGBA", "1": "L"}
# The first file of each class is read (its header only) when the dataset is built.
_PEEK_LIMIT = 1000

logger = logging.getLogger(__name__)


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
    found: list[str] = []
    for directory, subdirs, files in os.walk(folder, followlinks=True):
        subdirs[:] = sorted(d for d in subdirs if not d.startswith("."))
        found.extend(
            os.path.join(directory, name)
            for name in sorted(files)
            if not name.startswith(".") and name.lower().endswith(extensions)
        )
    return found


class ImageFolder(Dataset[Any]):
    """Images stored as ``root/<class name>/<file>``; samples are ``(image, class id)``.

    Class names are the sub-folders of ``root`` in sorted order, numbered from 0.
    Images are decoded with Pillow into the ``mode`` asked for: ``keep`` keeps each
    file's own mode (``L``: 1 channel, ``RGB``: 3, ``RGBA``: 4; palette and 1-bit images
    are expanded to the pixels they show), ``L``/``RGB``/``RGBA`` convert every file.
    Unset, images become RGB and the first file of another mode is logged once, so a
    grayscale folder never turns into 3 channels unsaid. ``image_mode`` and ``channels``
    say what the samples hold. Without a ``transform`` each image becomes a
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
        mode: ImageMode | None = None,
        extensions: Sequence[str] = IMAGE_EXTENSIONS,
        bad_records: BadRecordPolicy = "error",
        seed: int = 0,
    ) -> None:
        """Scan ``root`` for classes and image files (the files are read later, per sample).

        Args:
            root: The folder that holds one sub-folder per class.
            transform: Applied to each Pillow image; a stoker transform, a ``Compose``,
                or any one-argument callable (e.g. a torchvision transform).
            mode: ``keep`` (each file's own mode; every file must then have the same),
                or ``L``, ``RGB``, ``RGBA`` to convert every file to that Pillow mode.
                ``None`` converts to RGB and logs, once, a file that had another mode.
            extensions: File name endings that count as images (case-insensitive).
            bad_records: ``error`` raises on an unreadable image; ``skip`` hands it to
                the loader, which drops and logs it.
            seed: The run's seed, mixed with the epoch and index for augmentation.

        Raises:
            ConfigError: Pillow is missing, ``mode`` is not one of keep/L/RGB/RGBA, or
                ``bad_records`` is not error/skip.
            DataError: ``root`` is missing, has no class folders, a class folder holds
                no images, or under ``keep`` the first files of the classes differ in mode.
        """
        _pillow()  # fail now, not in a worker, when Pillow is missing
        if bad_records not in ("error", "skip"):
            raise ConfigError(
                f"bad_records={bad_records!r}; expected error or skip.",
                hint="set data.bad_records=error (stop) or skip (drop and log)",
            )
        if mode is not None and mode not in IMAGE_MODES:
            raise ConfigError(
                f"image folder mode={mode!r}; expected one of {', '.join(IMAGE_MODES)}.",
                hint="set mode: keep (each file's own), L (1 channel), RGB (3) or RGBA (4)",
            )
        self.mode: ImageMode | None = mode
        self.root = Path(root)
        self.extensions = tuple(e.lower() for e in extensions)
        self.bad_records: BadRecordPolicy = bad_records
        self.seed = int(seed)
        self.transform = transform
        self._transform = ToTensor() if transform is None else as_transform(transform)
        self._epoch = SharedEpoch()
        self._seeds = SampleSeeds(self.seed)
        self.classes, self.samples = self._scan()
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.targets = torch.tensor([target for _, target in self.samples], dtype=torch.long)
        # Shared, so the note about converted files is logged once whichever worker sees one.
        false = torch.zeros((), dtype=torch.bool)
        self._noted = false.share_memory_()  # type: ignore[no-untyped-call]  # torch: unannotated
        self._keep_source = ""  # under keep: the file whose mode every image must have
        self.image_mode: str = self._settle_mode()

    @property
    def channels(self) -> int:
        """Channels of a decoded image: 1 for ``L``, 3 for ``RGB``, 4 for ``RGBA``."""
        return int(_pillow().getmodebands(self.image_mode))

    def _settle_mode(self) -> str:
        """The mode samples are decoded to, checked on the first file of each class."""
        if self.mode not in (None, "keep"):
            return self.mode
        first: dict[int, str] = {}
        for path, target in self.samples:
            if target not in first and len(first) < _PEEK_LIMIT:
                first[target] = path
        peeked = {path: found for path in first.values() if (found := _header_mode(path))}
        if self.mode is None:
            other = next(((p, m) for p, m in peeked.items() if m != "RGB"), None)
            if other is not None:
                self._note_conversion(*other)
            return "RGB"
        if not peeked:
            raise DataError(
                f"image folder {str(self.root)!r}: none of the first files of its classes "
                "can be opened, so mode=keep has no mode to keep.",
                hint="check the files, or set mode: RGB (or L) to name the mode",
            )
        (self._keep_source, first_mode), *rest = peeked.items()
        for path, found in rest:
            if found != first_mode:
                raise self._mixed_modes(path, found, self._keep_source, first_mode)
        return first_mode

    def _mixed_modes(self, path: str, found: str, first_path: str, first_mode: str) -> DataError:
        return DataError(
            f"image folder {str(self.root)!r} mixes image modes under mode=keep: {path} is "
            f"{found} ({_bands(found)}) but {first_path} is {first_mode} "
            f"({_bands(first_mode)}); one batch cannot hold both.",
            hint="set mode: RGB in the image_folder args (e.g. data.train.args.mode=RGB), or "
            "mode: L for grayscale, so every image is converted to one mode",
        )

    def _note_conversion(self, path: str, found: str) -> None:
        """Say once per dataset (in any process) that a file of another mode became RGB."""
        if bool(self._noted):
            return
        self._noted.fill_(True)
        keep = "mode: L (or keep) to keep 1 channel" if found == "L" else "mode: keep to keep it"
        logger.warning(
            "image folder %s: %s is %s (%s) and is converted to RGB (3 channels), as every "
            "image is while `mode` is unset. Set mode: RGB to convert without this note, or %s.",
            self.root,
            path,
            found,
            _bands(found),
            keep,
        )

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
        """The epoch whose augmentations are applied (shared with the loader's workers)."""
        return self._epoch.value

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentations of ``epoch`` (``EpochLoader`` calls this)."""
        self._epoch.value = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int] | BadSample:
        i = operator.index(index) % len(self.samples)  # ds[-1] is ds[n - 1], augmentation too
        decoded = self.decode(i)
        if isinstance(decoded, BadSample):
            return decoded
        generator = None if self.transform is None else self._seeds.generator(self.epoch, i)
        # A plain int label: the collate function makes one tensor of the batch's labels.
        return self._transform(decoded, generator=generator), self.samples[i][1]

    def decode(self, index: int) -> Any:
        """The Pillow image of sample ``index`` in ``image_mode``, before any transform
        (a ``BadSample`` when the file cannot be decoded and ``bad_records`` is skip)."""
        i = operator.index(index)
        path = self.samples[i][0]
        image_module = _pillow()
        mode = self.image_mode
        try:
            with image_module.open(path) as image:
                found = image.mode
                # Decode the whole file here, so a truncated image fails here; convert()
                # would copy an image already in the mode asked for, so load() that one.
                wanted = _expanded(found) if self.mode == "keep" else mode
                if found == wanted:
                    image.load()
                    decoded = image
                else:
                    decoded = image.convert(wanted)
        except (OSError, ValueError, SyntaxError, image_module.DecompressionBombError) as error:
            return bad_record(
                self.bad_records,
                source=path,
                location=f"index {i % len(self.samples)}",
                reason=f"cannot decode image: {type(error).__name__}: {error}",
            )
        if decoded.mode != mode:  # only under keep: a file unlike the first ones
            raise self._mixed_modes(path, decoded.mode, self._keep_source, mode)
        if self.mode is None and _expanded(found) != mode:
            self._note_conversion(path, found)
        return decoded

    def __repr__(self) -> str:
        return (
            f"ImageFolder({str(self.root)!r}: {len(self.samples)} images, "
            f"{len(self.classes)} classes, mode {self.image_mode}, {_bands(self.image_mode)})"
        )


def _expanded(mode: str) -> str:
    """The mode ``keep`` decodes a file of ``mode`` to (palette and 1-bit images expanded)."""
    return _EXPANDED.get(mode, mode)


def _bands(mode: str) -> str:
    count = _pillow().getmodebands(mode)
    return f"{count} channel{'s' * (count != 1)}"


def _header_mode(path: str) -> str | None:
    """The mode ``keep`` gives the file at ``path``, from its header; None if unreadable."""
    image_module = _pillow()
    try:
        with image_module.open(path) as image:
            return _expanded(image.mode)
    except (OSError, ValueError, SyntaxError, image_module.DecompressionBombError):
        return None


@dataclass(frozen=True)
class ImageSurvey:
    """What the files of an image folder hold, read from their headers (no decoding)."""

    sizes: Counter[tuple[int, int]] = field(default_factory=Counter)  # (width, height)
    modes: Counter[str] = field(default_factory=Counter)  # as stored in the files
    unreadable: list[str] = field(default_factory=list)

    @property
    def kept_modes(self) -> Counter[str]:
        """The modes ``mode: keep`` decodes the files to (palette and 1-bit expanded)."""
        kept: Counter[str] = Counter()
        for mode, count in self.modes.items():
            kept[_expanded(mode)] += count
        return kept

    @classmethod
    def of(cls, paths: Iterable[str]) -> ImageSurvey:
        """Survey ``paths``: Pillow reads each file's size and mode without its pixels."""
        image_module = _pillow()
        survey = cls()
        for path in paths:
            try:
                with image_module.open(path) as image:
                    survey.sizes[image.size] += 1
                    survey.modes[image.mode] += 1
            except (OSError, ValueError, SyntaxError, image_module.DecompressionBombError):
                survey.unreadable.append(path)
        return survey
