"""examples/images: grayscale PNG digits and augmented RGB shapes, trained through the CLI.

Each example writes its PNG files on first use (here under tmp_path, so tests share
nothing) and reads them back with image_folder, as a user's folder would be read. The
runs are short versions of the examples; their bars are far above chance.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from types import ModuleType

import pytest
from PIL import Image

from stoker.errors import DataError
from stoker_cli import run_cli

EXAMPLES = Path(__file__).parents[2] / "examples" / "images"


def stoker(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in-process (tests/stoker_cli.py): a fresh interpreter would add only its
    start-up; `stoker train` and `stoker data inspect` as processes are tested elsewhere.

    One intra-op thread: the suite runs a pytest worker per core, and these small convs
    on two threads of a busy core were measured 5-10x slower (each op waits for both).
    """
    return run_cli(*args, threads=1)


def train(config: str, run_dir: Path, *overrides: str) -> list[dict]:
    """Train an example with ``overrides``; the per-epoch records that hold val metrics."""
    done = stoker(
        "train", str(EXAMPLES / config), *overrides, "tracking.tensorboard=false",
        "--run-dir", str(run_dir), "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r for r in records if "val/accuracy" in r]


def test_digits_png_trains_on_one_channel_and_inspect_shows_the_folder(tmp_path: Path) -> None:
    data = tmp_path / "digits"
    epochs = train(
        "digits.yaml", tmp_path / "run", "train.epochs=2", f"data.train.args.root={data}"
    )
    assert len(epochs) == 2
    # Ten classes: chance is 0.1; two epochs measured 0.936 and 0.939 (seeds 0 and 1).
    assert epochs[-1]["val/accuracy"] >= 0.85
    assert epochs[-1]["train/loss"] < epochs[0]["train/loss"]
    assert len(list(data.glob("*/*.png"))) == 1797 and (data / "stoker-example.json").is_file()

    shown = stoker("data", "inspect", str(data))
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "(image folder)" in out and "samples:     1,797" in out
    assert "classes (10):" in out and "0: 178 images" in out and "9: 180 images" in out
    assert "image sizes (width×height): 16×16: 1,797" in out
    assert "image modes: L: 1,797" in out
    assert "image: float32 [1, 16, 16] per sample in [0, 1] (mode L, 1 channel)" in out
    assert "set mode: keep or L" in out
    assert "WARNING" not in shown.stderr


def test_shapes_png_trains_with_augmentation_on_rgb(tmp_path: Path) -> None:
    data = tmp_path / "shapes"
    epochs = train(
        "shapes.yaml", tmp_path / "run", "train.epochs=2",
        f"data.train.args.root={data}", f"data.val.args.root={data}",
    )  # fmt: skip
    assert len(epochs) == 2
    # Four classes: chance is 0.25; two epochs measured 0.975 and 0.985 (seeds 0 and 1).
    assert epochs[-1]["val/accuracy"] >= 0.85
    assert len(list((data / "train").glob("*/*.png"))) == 2000
    assert len(list((data / "val").glob("*/*.png"))) == 400
    with Image.open(next((data / "val" / "circle").glob("*.png"))) as image:
        assert image.mode == "RGB" and image.size == (32, 32)


def test_inspect_a_folder_of_mixed_modes_and_sizes(tmp_path: Path) -> None:
    root = tmp_path / "photos"
    for label, count in (("cat", 3), ("dog", 2)):
        (root / label).mkdir(parents=True)
        for i in range(count):
            Image.new("RGB", (10 + i, 8), (i * 40, 10, 200)).save(root / label / f"{i}.png")
    Image.new("L", (10, 8), 90).save(root / "dog" / "gray.png")
    (root / "dog" / "broken.jpg").write_bytes(b"no jpeg here")
    shown = stoker("data", "inspect", str(root), "--rows", "1")
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert "cat: 3 images" in out and "dog: 4 images" in out
    assert "image sizes (width×height): 10×8: 3, 11×8: 2, 12×8: 1" in out
    assert "image modes: RGB: 5, L: 1" in out
    assert "mixed modes (L, RGB): set mode: RGB (or L)" in out
    assert f"unreadable: 1 file(s), e.g. {root / 'dog' / 'broken.jpg'}" in out


def load_make_data() -> ModuleType:
    spec = importlib.util.spec_from_file_location("zoo_make_data", EXAMPLES / "make_data.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_an_interrupted_write_is_never_taken_for_a_finished_folder(tmp_path: Path) -> None:
    make_data = load_make_data()
    folder = tmp_path / "data" / "set"
    manifest = {"dataset": "set", "version": 1}

    def interrupted(partial: Path) -> int:
        (partial / "a").mkdir(parents=True)
        (partial / "a" / "0.png").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        make_data._ensure(folder, manifest, interrupted)
    assert list((tmp_path / "data").iterdir()) == []  # no folder, no partial one left

    def complete(partial: Path) -> int:
        (partial / "a").mkdir(parents=True)
        Image.new("L", (2, 2)).save(partial / "a" / "0.png")
        return 1

    assert make_data._ensure(folder, manifest, complete) == folder
    assert json.loads((folder / "stoker-example.json").read_text())["files"] == 1
    assert make_data._ensure(folder, manifest, interrupted) == folder  # found: not rewritten
    with pytest.raises(DataError, match=r"(?s)not written by this example.*delete"):
        make_data._ensure(folder, {"dataset": "other", "version": 1}, complete)
