"""Image folders for the examples, written once as PNG files and read by ``image_folder``.

A config names a function here as its dataset (``data.train: {name:
"make_data.py:digits_png"}``). On the first call it writes the files, deterministically,
under ``data/`` beside this file (gitignored); every later call finds them and reuses
them. Either way it returns what ``data.train: {name: image_folder, args: {...}}`` would
build on a folder of your own, so the examples train through stoker's image path exactly
as a user's files do.

A folder is written into a temporary sibling and renamed into place when complete, so an
interrupted write is never taken for a finished one. A ``stoker-example.json`` inside
records what was written; a folder that says otherwise is an error, not silently reused.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw

from stoker.data.builtins import image_folder
from stoker.data.images import ImageFolder, ImageMode
from stoker.data.records import BadRecordPolicy
from stoker.errors import DataError

HERE = Path(__file__).resolve().parent
MANIFEST = "stoker-example.json"
SHAPES = ("circle", "cross", "square", "triangle")


def digits_png(
    *,
    root: str = "data/digits",
    mode: ImageMode | None = "keep",
    bad_records: BadRecordPolicy = "error",
) -> ImageFolder:
    """scikit-learn's 1,797 handwritten digits as 16×16 grayscale PNGs, one folder per digit.

    Args:
        root: Where the folder is (written on first use); relative to this file's folder,
            which is the config's.
        mode: The ``image_folder`` mode; ``keep`` gives the files' 1 channel (mode L).
        bad_records: The run's policy for unreadable files.
    """
    folder = _ensure(_resolve(root), {"dataset": "digits", "version": 1}, _write_digits)
    return image_folder(str(folder), mode=mode, bad_records=bad_records)


def shapes_png(
    *,
    split: Literal["train", "val"],
    root: str = "data/shapes",
    mode: ImageMode | None = "RGB",
    size: int | None = 32,
    augment: bool = False,
    seed: int = 0,
    bad_records: BadRecordPolicy = "error",
) -> ImageFolder:
    """Coloured circles, crosses, squares and triangles on coloured backgrounds, 32×32 RGB.

    The shape's colour, size, place and turn and the background vary at random, so only
    the outline tells the class. 2,000 training and 400 validation images (a quarter
    per class), drawn from a fixed seed.

    Args:
        split: ``train`` or ``val`` (both folders are written on first use).
        root: The folder holding ``train/`` and ``val/``; relative to this file's folder.
        mode: The ``image_folder`` mode.
        size: Resize to size×size (``image_folder``'s ``size``; also the crop size).
        augment: ``image_folder``'s padded random crop and horizontal flip.
        seed: The run's seed, which picks each epoch's augmentation.
        bad_records: The run's policy for unreadable files.
    """
    if split not in ("train", "val"):
        raise DataError(
            f"shapes_png split={split!r}; expected train or val.",
            hint="set data.train.args.split: train and data.val.args.split: val",
        )
    folder = _ensure(_resolve(root), {"dataset": "shapes", "version": 1}, _write_shapes)
    return image_folder(
        str(folder / split),
        mode=mode,
        size=size,
        augment=augment,
        seed=seed,
        bad_records=bad_records,
    )


def _resolve(root: str) -> Path:
    path = Path(root).expanduser()
    return path if path.is_absolute() else HERE / path


def _ensure(folder: Path, manifest: dict, write: Callable[[Path], int]) -> Path:
    """``folder``, written by ``write`` unless a complete copy of the same data is there."""
    if not folder.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        partial = folder.parent / f".{folder.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            files = write(partial)
            (partial / MANIFEST).write_text(json.dumps({**manifest, "files": files}) + "\n")
            try:
                partial.rename(folder)
            except OSError:
                if not folder.exists():
                    raise  # another process did not win the race: a real failure
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    try:
        found = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        found = None
    if not isinstance(found, dict) or {k: found.get(k) for k in manifest} != manifest:
        raise DataError(
            f"{folder} exists but was not written by this example ({MANIFEST} is missing "
            f"or says {found!r}, expected {manifest!r}).",
            hint=f"delete {folder} to have it written again, or give the dataset another root",
        )
    return folder


def _write_digits(folder: Path) -> int:
    from sklearn.datasets import load_digits

    digits = load_digits()
    for digit in range(10):
        (folder / str(digit)).mkdir(parents=True)
    for index, (pixels, digit) in enumerate(zip(digits.images, digits.target, strict=True)):
        gray = np.rint(pixels * (255 / 16)).astype(np.uint8)  # 17 levels (0-16) to 0-255
        image = Image.fromarray(gray, mode="L").resize((16, 16), Image.Resampling.BILINEAR)
        _save_png(image, folder / str(digit) / f"{index:04d}.png")
    return len(digits.target)


def _save_png(image: Image.Image, path: Path) -> None:
    """Encode in memory, then write: ten times faster than Pillow writing to the path."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    path.write_bytes(buffer.getvalue())


def _write_shapes(folder: Path) -> int:
    rng = np.random.default_rng(20240611)  # the data, not the run: fixed for every run
    written = 0
    for split, per_class in (("train", 500), ("val", 100)):
        for name in SHAPES:
            (folder / split / name).mkdir(parents=True)
        for index in range(per_class * len(SHAPES)):
            name = SHAPES[index % len(SHAPES)]
            _save_png(_draw_shape(name, rng), folder / split / name / f"{index:04d}.png")
            written += 1
    return written


def _draw_shape(name: str, rng: np.random.Generator, *, side: int = 32, scale: int = 4) -> Image:
    """One shape on a shaded ground; its outline drawn 4× larger and scaled down, so smooth."""
    # Any hue for either, but the shape is lighter than its background, as a lit object
    # on a darker ground: a small CNN then learns outlines in a few epochs.
    background = rng.integers(0, 140, 3)
    colour = rng.integers(110, 256, 3)
    corners = rng.integers(0, 140, (2, 2, 3)).astype(np.float32)  # a soft colour gradient
    t = np.linspace(0.0, 1.0, side, dtype=np.float32)[:, None, None]
    s = np.linspace(0.0, 1.0, side, dtype=np.float32)[None, :, None]
    gradient = (1 - t) * ((1 - s) * corners[0, 0] + s * corners[0, 1]) + t * (
        (1 - s) * corners[1, 0] + s * corners[1, 1]
    )
    big = side * scale
    radius = rng.uniform(0.16, 0.32) * big
    cx, cy = rng.uniform(radius + 2, big - radius - 2, 2)
    turn = rng.uniform(0, 2 * math.pi)

    def polygon(angles: list[float], radii: list[float]) -> list[tuple[float, float]]:
        return [
            (cx + r * math.cos(turn + a), cy + r * math.sin(turn + a))
            for a, r in zip(angles, radii, strict=True)
        ]

    mask = Image.new("L", (big, big))
    draw = ImageDraw.Draw(mask)
    if name == "circle":
        draw.ellipse((cx - radius, cy - radius, cx + radius, cy + radius), fill=255)
    elif name == "square":
        draw.polygon(polygon([math.pi / 4 + k * math.pi / 2 for k in range(4)], [radius] * 4), 255)
    elif name == "triangle":
        draw.polygon(polygon([k * 2 * math.pi / 3 for k in range(3)], [radius * 1.1] * 3), 255)
    else:  # a plus sign: 12 corners, alternately at the arm ends and the inner corners
        arm, half = radius, radius * 0.32
        outline = [(half, arm), (-half, arm), (-half, half), (-arm, half), (-arm, -half),
                   (-half, -half), (-half, -arm), (half, -arm), (half, -half), (arm, -half),
                   (arm, half), (half, half)]  # fmt: skip
        angles = [math.atan2(y, x) for x, y in outline]
        radii = [math.hypot(x, y) for x, y in outline]
        draw.polygon(polygon(angles, radii), 255)
    cover = np.asarray(mask.resize((side, side), Image.Resampling.BOX), dtype=np.float32)
    cover = cover[:, :, None] / 255.0  # the share of each pixel the shape covers
    ground = 0.7 * background + 0.3 * gradient
    pixels = (1 - cover) * ground + cover * colour + rng.normal(0, 10, (side, side, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), mode="RGB")
