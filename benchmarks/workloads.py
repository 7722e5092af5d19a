"""Realistic workloads, side by side: image files with augmentation, a user's own
per-sample Dataset and a CNN in memory, each stoker vs the plain PyTorch a user would
write (and Lightning, where it is the user's alternative). The other two workloads are
apart: variable-length text in ``workloads_text.py``, out-of-core Parquet (against
pyarrow and HF ``datasets``) in ``workloads_parquet.py``.

Images (``--files`` PNGs of 32×32 RGB in 10 class folders, made once in a temp dir):
every contender iterates one shuffled epoch of batches of 64 with a zero-padded (4)
random 32×32 crop and a horizontal flip, ``--workers`` loader processes:

- ``plain``: a PIL ``Dataset`` (open, convert RGB, to tensor, pad, crop, flip: the
  torchvision recipe without torchvision, whose wheel does not import here) through a
  ``DataLoader``;
- ``folder``: stoker's ``image_folder(size=32, augment=True)`` through
  ``stoker.build_loader``;
- ``cached``: the same folder through ``DecodedImages`` (``data.cache``), decoded once
  before the timed epochs (that one-off cost is shown apart); the same crops and flips
  as ``folder`` (a unit test holds them bitwise equal).

Timed: the whole epoch, per image. Targets: folder / plain <= 1.03, plain / cached >= 2.

Per-sample Dataset: the seed module's ``CSVWindowDataset`` (10,000 rows of 20 floats,
one numpy row per ``__getitem__``) and MLP, Adam lr 1e-2, batch 64, ``--epochs`` epochs:

- ``hand``: the seed's loop over ``DataLoader(dataset, batch_size=64, shuffle=True)``;
- ``stoker``: ``stoker.fit(model, dataset, cache="memory")``: read once into arrays.

- ``lightning``: ``Trainer.fit`` on the hand loop's DataLoader and optimizer.

Timed: epochs 2 onward (forward to forward, as in trainer.py), and the first epoch
apart. Target: hand / stoker >= 1.8 from epoch 2.

CNN in memory (``--cnn-samples`` random 1×28×28 images, 10 classes, a two-layer conv
net, Adam lr 1e-3, one epoch): ``hand`` is ``DataLoader(TensorDataset)`` and the seed's
loop body, ``stoker`` is ``stoker.fit(model, (images, labels))``, ``lightning``
``Trainer.fit`` on the hand loop's DataLoader. Compute-bound: target stoker / hand train
time <= 1.03.

Lightning runs where it is installed (``make bench`` installs it), its rows say "not
installed" otherwise; ``Trainer(max_epochs, accelerator="cpu", devices=1)`` with no
logger, checkpoints, progress bar or model summary.

Contenders alternate round by round after a warm-up round; medians of per-round ratios;
the 1-minute load average is recorded before and after.

    python benchmarks/workloads.py --out bench-out
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Check,
    CSVWindowDataset,
    Result,
    StepStamps,
    info,
    interleaved,
    lightning_fit,
    lightning_status,
    lightning_version,
    median,
    paired_ratio,
    seed_model,
    set_threads,
    table,
    target_check,
    weights_of,
)

import stoker
from stoker.data.builtins import image_folder
from stoker.data.image_cache import DecodedImages

BATCH = 64
SIZE, PAD = 32, 4


def make_images(root: Path, count: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        folder = root / f"class{i % 10}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:05d}.png")
    return root


class PlainImages(Dataset):
    """What a user writes without torchvision: PIL decode, to tensor, pad, crop, flip."""

    def __init__(self, root: Path) -> None:
        self.files = sorted(root.glob("*/*.png"))
        classes = sorted({f.parent.name for f in self.files})
        self.labels = [classes.index(f.parent.name) for f in self.files]

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        from PIL import Image

        with Image.open(self.files[index]) as image:
            array = np.array(image.convert("RGB"))
        x = torch.from_numpy(array).permute(2, 0, 1).float().div(255.0)
        x = F.pad(x, (PAD,) * 4)
        top, left = torch.randint(2 * PAD + 1, (2,)).tolist()
        x = x[:, top : top + SIZE, left : left + SIZE]
        if torch.rand(()) < 0.5:
            x = x.flip(-1)
        return x, self.labels[index]


def epoch_s(loader: Any) -> float:
    started = time.perf_counter()
    for images, _ in loader:
        assert images.shape[1:] == (3, SIZE, SIZE)
    return time.perf_counter() - started


def images_benchmark(root: Path, rounds: int, workers: int) -> tuple[dict, list]:
    bench = "workloads"
    plain = DataLoader(PlainImages(root), batch_size=BATCH, shuffle=True, num_workers=workers)
    folder = image_folder(str(root), size=SIZE, augment=True, seed=0)
    count = len(folder)
    started = time.perf_counter()
    cached = DecodedImages(image_folder(str(root), size=SIZE, augment=True, seed=0))
    decode_s = time.perf_counter() - started
    loaders = {
        "plain": plain,
        "folder": stoker.build_loader(
            folder, batch_size=BATCH, shuffle=True, num_workers=workers, seed=0
        ),
        "cached": stoker.build_loader(
            cached, batch_size=BATCH, shuffle=True, num_workers=workers, seed=0
        ),
    }
    epochs = {name: 0 for name in loaders}

    def run(name: str):
        def one() -> float:
            loader = loaders[name]
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epochs[name])
            epochs[name] += 1
            return epoch_s(loader)

        return one

    records = interleaved({name: run(name) for name in loaders}, rounds=rounds)
    per_image = {name: median(values) / count * 1e6 for name, values in records.items()}
    checks = [
        info(bench, f"images: {name} per image", value, unit="us")
        for name, value in per_image.items()
    ]
    checks += [
        target_check(
            bench,
            "images: stoker folder / plain PIL Dataset (epoch time)",
            paired_ratio(records["folder"], records["plain"]),
            "<=",
            1.03,
        ),
        target_check(
            bench,
            "images: plain / stoker decoded cache, epochs >= 2",
            paired_ratio(records["plain"], records["cached"]),
            ">=",
            2.0,
        ),
        info(bench, "images: decoding the cache once", decode_s, unit="s"),
    ]
    return {"per_image_us": per_image, "epoch_s": records, "files": count}, checks


def _span(stamps: list[float]) -> float:
    return stamps[-1] - stamps[0] if len(stamps) > 1 else float("nan")


def lightning_check(figure: str, records: dict[str, list[float]], skipped: str) -> Check:
    """Lightning / hand loop (no target), or the row that says why Lightning did not run."""
    if skipped:
        return Check("workloads", figure, None, status=skipped)
    return info("workloads", figure, paired_ratio(records["lightning"], records["hand"]), unit="x")


def dataset_benchmark(rounds: int, epochs: int) -> tuple[dict, list]:
    bench = "workloads"
    dataset = CSVWindowDataset()
    steps_per_epoch = -(-len(dataset) // BATCH)
    init = weights_of(seed_model())
    root = Path(tempfile.mkdtemp(prefix="stoker-workloads-"))

    def timed(run) -> dict[str, float]:
        model = seed_model()
        model.load_state_dict(init)
        stamps = StepStamps(model, cpu=True)
        run(model)
        stamps.remove()
        times: dict[str, float] = {}
        for kind, readings in (("", stamps.stamps), ("cpu_", stamps.cpu_stamps)):
            per_epoch = [
                readings[i : i + steps_per_epoch] for i in range(0, len(readings), steps_per_epoch)
            ]
            times[f"{kind}first_s"] = _span(per_epoch[0])
            times[f"{kind}later_s"] = sum(_span(e) * len(e) / (len(e) - 1) for e in per_epoch[1:])
        return times

    def hand(model: nn.Module) -> None:
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        loss_fn = nn.CrossEntropyLoss()
        for _ in range(epochs):
            for xb, yb in loader:
                loss = loss_fn(model(xb), yb)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

    def fit(model: nn.Module) -> None:
        stoker.fit(
            model,
            CSVWindowDataset(),  # a fresh one: the cache is built inside the run
            epochs=epochs,
            batch_size=BATCH,
            optimizer="adam",
            lr=1e-2,
            cache="memory",
            threads=torch.get_num_threads(),
            seed=0,
            progress="quiet",
            tensorboard=False,
            enabled=False,
            run_dir=tempfile.mkdtemp(dir=root),
        )

    def lightning(model: nn.Module) -> None:
        loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
        lightning_fit(model, loader, epochs, lambda p: torch.optim.Adam(p, lr=1e-2))

    contenders = {"hand": lambda: timed(hand), "stoker": lambda: timed(fit)}
    skipped = lightning_status()
    if not skipped:
        contenders["lightning"] = lambda: timed(lightning)
    records = interleaved(contenders, rounds=rounds)
    later = {k: [r["later_s"] for r in v] for k, v in records.items()}
    first = {k: [r["first_s"] for r in v] for k, v in records.items()}
    cpu_later = {k: [r["cpu_later_s"] for r in v] for k, v in records.items()}
    checks = [
        target_check(
            bench,
            "own Dataset: hand loop / stoker cache=memory, epochs >= 2",
            paired_ratio(later["hand"], later["stoker"]),
            ">=",
            1.8,
        ),
        info(
            bench,
            "own Dataset: CPU time, hand loop / stoker cache=memory, epochs >= 2",
            paired_ratio(cpu_later["hand"], cpu_later["stoker"]),
            unit="x",
            note="this process's CPU time: less disturbed by other jobs than the wall clock",
        ),
        info(
            bench,
            "own Dataset: hand / stoker, first epoch (stoker reads into arrays)",
            paired_ratio(first["hand"], first["stoker"]),
            unit="x",
        ),
        lightning_check("own Dataset: lightning / hand loop, epochs >= 2", later, skipped),
    ]
    return {"later_s": later, "cpu_later_s": cpu_later, "first_s": first, "epochs": epochs}, checks


def cnn_benchmark(rounds: int, samples: int) -> tuple[dict, list]:
    """A small CNN on in-memory 28×28 images: compute-bound, one epoch per run."""
    bench = "workloads"
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(samples, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    steps = -(-samples // BATCH)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )

    root = Path(tempfile.mkdtemp(prefix="stoker-cnn-"))

    def timed(run) -> dict[str, float]:
        net = model()
        stamps = StepStamps(net, cpu=True)
        run(net)
        stamps.remove()
        scale = steps / max(1, len(stamps.stamps) - 1)
        return {"train_s": _span(stamps.stamps) * scale, "cpu_s": _span(stamps.cpu_stamps) * scale}

    def hand(net: nn.Module) -> None:
        data = torch.utils.data.TensorDataset(images, labels)
        optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
        loss_fn = nn.CrossEntropyLoss()
        for xb, yb in DataLoader(data, batch_size=BATCH, shuffle=True):
            loss = loss_fn(net(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    def fit(net: nn.Module) -> None:
        stoker.fit(
            net,
            (images, labels),
            epochs=1,
            batch_size=BATCH,
            optimizer="adam",
            lr=1e-3,
            threads=torch.get_num_threads(),
            seed=0,
            progress="quiet",
            tensorboard=False,
            enabled=False,
            run_dir=tempfile.mkdtemp(dir=root),
        )

    def lightning(net: nn.Module) -> None:
        loader = DataLoader(torch.utils.data.TensorDataset(images, labels), BATCH, shuffle=True)
        lightning_fit(net, loader, 1, lambda p: torch.optim.Adam(p, lr=1e-3))

    contenders = {"hand": lambda: timed(hand), "stoker": lambda: timed(fit)}
    skipped = lightning_status()
    if not skipped:
        contenders["lightning"] = lambda: timed(lightning)
    runs = interleaved(contenders, rounds=rounds)
    records = {name: [r["train_s"] for r in rs] for name, rs in runs.items()}
    cpu = {name: [r["cpu_s"] for r in rs] for name, rs in runs.items()}
    checks = [
        target_check(
            bench,
            "CNN, in-memory 28x28 images: stoker / hand loop, train time",
            paired_ratio(records["stoker"], records["hand"]),
            "<=",
            1.03,
            note="compute-bound: the loop's overhead is a small share of a long step",
        ),
        info(
            bench,
            "CNN: stoker / hand loop, CPU time",
            paired_ratio(cpu["stoker"], cpu["hand"]),
            unit="x",
        ),
        lightning_check("CNN: lightning / hand loop, train time", records, skipped),
    ]
    return {"train_s": records, "cpu_s": cpu, "samples": samples}, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--files", type=int, default=4000)
    parser.add_argument("--workers", type=int, default=0, help="loader processes (images)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (own Dataset)")
    parser.add_argument("--cnn-samples", type=int, default=10_000, help="CNN images (0: skip)")
    args = parser.parse_args()
    set_threads(args.threads)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="stoker-images-") as tmp:
        root = make_images(Path(tmp), args.files)
        image_figures, image_checks = images_benchmark(root, args.rounds, args.workers)
    data_figures, data_checks = dataset_benchmark(args.rounds, args.epochs)
    cnn_figures, cnn_checks = ({}, [])
    if args.cnn_samples:
        cnn_figures, cnn_checks = cnn_benchmark(args.rounds, args.cnn_samples)
    load_after = os.getloadavg()[0]
    checks = image_checks + data_checks + cnn_checks
    checks.append(info("workloads", "load average 1 min before", load_before, unit=""))
    checks.append(info("workloads", "load average 1 min after", load_after, unit=""))
    print(table(checks))
    result = Result(
        benchmark="workloads",
        timed="images: whole epochs per image; own Dataset: epochs >= 2, forward to forward",
        workload={
            "files": args.files,
            "workers": args.workers,
            "threads": args.threads,
            "rounds": args.rounds,
            "epochs": args.epochs,
            "cnn_samples": args.cnn_samples,
            "lightning": lightning_version(),
        },
        figures={"images": image_figures, "own_dataset": data_figures, "cnn": cnn_figures},
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
