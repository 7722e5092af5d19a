"""``stoker data inspect PATH`` and ``stoker data convert SRC DST``: look at and prepare data."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from stoker.errors import DataError

# The data modules import torch (two seconds): each verb imports what it needs when it runs,
# so that `stoker --help` and `stoker data --help` answer at once (see stoker.cli.main).

_SHOWN_CLASSES = 20  # an image folder's classes listed one a line; more are summarized
_SHOWN_SIZES = 5


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
    """Add ``stoker data`` and its arguments to the CLI's subcommands."""
    parser = subparsers.add_parser(
        "data",
        parents=parents,
        help="inspect a data set, or convert CSV to Parquet/.npy",
        description="Look at a data set before training on it, or convert it once for speed.",
    )
    verbs = parser.add_subparsers(dest="data_command", metavar="VERB", required=True)

    inspect = verbs.add_parser(
        "inspect",
        parents=parents,
        help="schema or shapes, sample count, size on disk, fingerprint, first samples",
        description=(
            "Print what a data set holds: .parquet (file or folder), .npy (file or folder), "
            ".csv, .jsonl, or an image folder (one sub-folder per class)."
        ),
    )
    inspect.add_argument("path", metavar="PATH")
    inspect.add_argument("--rows", type=int, default=3, help="samples to show (default 3)")
    inspect.add_argument("--full", action="store_true", help="fingerprint every byte")
    inspect.set_defaults(run=run_inspect)

    convert = verbs.add_parser(
        "convert",
        parents=parents,
        help="convert a CSV file to Parquet or .npy, streamed in chunks",
        description=(
            "Convert a CSV file once, in bounded memory, to a format that later epochs read "
            "fast: Parquet (a file) or .npy (a folder with features.npy and target.npy)."
        ),
    )
    convert.add_argument("src", metavar="SRC", help="the CSV file")
    convert.add_argument("dst", metavar="DST", help="the output file (parquet) or folder (npy)")
    convert.add_argument("--to", choices=("parquet", "npy"), required=True)
    convert.add_argument("--target", help="the label column (default: none)")
    convert.add_argument("--features", nargs="+", help="feature columns (default: all others)")
    convert.add_argument("--delimiter", default=",")
    convert.add_argument(
        "--bad-records",
        choices=("error", "skip"),
        default="error",
        help="stop at a malformed row (default), or skip and list it",
    )
    convert.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    convert.set_defaults(run=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    """``stoker data convert``: convert a CSV once to Parquet or .npy; returns the exit code."""
    from stoker.data.convert import convert_csv

    report = convert_csv(
        args.src,
        args.dst,
        to=args.to,
        features=args.features,
        target=args.target,
        delimiter=args.delimiter,
        bad_records=args.bad_records,
        overwrite=args.overwrite,
    )
    print(report.summary())
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    """``stoker data inspect``: print a data set's layout and fingerprint; returns the exit code."""
    from stoker.cli.data_light import open_light
    from stoker.data.digests import fingerprint_files

    path = Path(args.path)
    if not path.exists():
        raise DataError(f"{path} does not exist", hint="give a file or folder of data")
    # CSV, Parquet and .npy in the common case without torch (see stoker.cli.data_light).
    light = open_light(path, args.rows, {p.suffix for p in _files(path)})
    if light is not None:
        kind, length, schema, details = light.kind, light.length, light.schema, []
        sample = light.samples.__getitem__
        size = sum(f.stat().st_size for f in _files(path))
        fingerprint = fingerprint_files(light.paths, full=args.full, num_samples=length)
    else:
        from stoker.data.fingerprint import fingerprint_dataset

        dataset, kind, schema, details = open_for_inspection(path)
        length, sample = len(dataset), dataset.__getitem__
        size = sum(f.stat().st_size for f in _files(path))
        fingerprint = fingerprint_dataset(dataset, full=args.full)
        if fingerprint.kind == "unknown":
            fingerprint = fingerprint_files(path, full=args.full)
    print(f"{path}  ({kind})")
    print(f"  samples:     {length:,}")
    print(f"  size:        {_human(size)} on disk")
    print(f"  fingerprint: {fingerprint.short} ({fingerprint.mode})")
    print("  schema:")
    for name, description in schema.items():
        print(f"    {name}: {description}")
    for line in details:
        print(f"  {line}")
    rows = min(args.rows, length)
    if rows:
        print(f"  first {rows} sample{'s' * (rows != 1)}:")
        for index in range(rows):
            print(f"    [{index}] {_show(sample(index))}")
    return 0


def open_for_inspection(path: Path) -> tuple[Any, str, dict[str, str], list[str]]:
    """The dataset at ``path``, its kind, its schema as {field: description}, more lines."""
    from stoker.data import builtins

    suffixes = {p.suffix for p in _files(path)}
    if path.suffix == ".parquet" or (path.is_dir() and suffixes == {".parquet"}):
        dataset = builtins.parquet(str(path))
        return dataset, "parquet", dataset.schema(), []
    if path.suffix == ".npy" or (path.is_dir() and suffixes == {".npy"}):
        dataset = builtins.npy(str(path) if path.is_dir() else [str(path)])
        return dataset, "npy", _shapes(dataset), []
    if path.suffix == ".csv":
        dataset = builtins.csv(str(path))
        return dataset, "csv", {name: "column" for name in dataset.columns}, []
    if path.suffix == ".jsonl":
        dataset = builtins.jsonl(str(path), tokenizer="byte")
        classes = getattr(dataset, "classes", None)
        schema = {"text": "str → byte tokens", "label": f"classes {classes}" if classes else "int"}
        return dataset, "jsonl", schema, []
    if path.is_dir():
        return _image_folder(path)
    raise DataError(
        f"stoker data inspect does not know the format of {path}",
        hint="give a .parquet, .npy, .csv or .jsonl file, or a folder of them or of images",
    )


def _image_folder(path: Path) -> tuple[Any, str, dict[str, str], list[str]]:
    """An image folder: classes and counts, and the files' sizes and modes from their headers.

    The samples shown are decoded as ``mode: keep`` when every file has one mode, so they
    show the files' own channels; a folder of mixed modes is shown as RGB.
    """
    import torch

    from stoker.data.images import ImageFolder, ImageSurvey

    listing = ImageFolder(path, mode="RGB")  # mode named: scans without peeking or notes
    survey = ImageSurvey.of(file for file, _ in listing.samples)
    kept = set(survey.kept_modes)
    dataset = ImageFolder(path, mode="keep") if len(kept) == 1 else listing
    counts = torch.bincount(listing.targets, minlength=len(listing.classes)).tolist()
    single = next(iter(survey.sizes)) if len(survey.sizes) == 1 else None
    shape = f"[{dataset.channels}, {single[1]}, {single[0]}]" if single else "[C, H, W]"
    channels = f"{dataset.channels} channel{'s' * (dataset.channels != 1)}"
    schema = {
        "image": f"float32 {shape} per sample in [0, 1] (mode {dataset.image_mode}, {channels})",
        "label": f"int64, {len(listing.classes)} classes",
    }
    lines = [f"classes ({len(listing.classes)}):"]
    shown = list(zip(listing.classes, counts, strict=True))
    lines += [f"  {name}: {count:,} images" for name, count in shown[:_SHOWN_CLASSES]]
    if len(shown) > _SHOWN_CLASSES:
        rest = counts[_SHOWN_CLASSES:]
        lines.append(f"  … {len(rest)} more classes, {min(rest):,} to {max(rest):,} images each")
    lines.append("image sizes (width×height): " + _counted(survey.sizes, _SHOWN_SIZES))
    if len(survey.sizes) > _SHOWN_SIZES:
        widths = [w for w, _ in survey.sizes]
        heights = [h for _, h in survey.sizes]
        lines.append(
            f"  widths {min(widths)} to {max(widths)}, heights {min(heights)} to "
            f"{max(heights)}: give image_folder a size (e.g. size: 224) so they batch"
        )
    lines.append("image modes: " + _counted(survey.modes, len(survey.modes)))
    lines.append(_mode_advice(kept))
    if survey.unreadable:
        lines.append(
            f"unreadable: {len(survey.unreadable):,} file(s), e.g. {survey.unreadable[0]} "
            "(data.bad_records=skip drops and logs them)"
        )
    return dataset, "image folder", schema, lines


def _counted(counts: Any, shown: int) -> str:
    """``16×16: 1,797, 8×8: 3`` for the most common ``shown`` keys of a Counter."""
    parts = []
    for key, count in counts.most_common(shown):
        name = "×".join(str(v) for v in key) if isinstance(key, tuple) else str(key)
        parts.append(f"{name}: {count:,}")
    more = len(counts) - shown
    return ", ".join(parts) + (f", … {more} more" if more > 0 else "") if parts else "none"


def _mode_advice(kept: set[str]) -> str:
    """What `mode` to give image_folder for these files, said once."""
    from stoker.data.images import IMAGE_MODES

    if len(kept) > 1:
        return (
            f"mixed modes ({', '.join(sorted(kept))}): set mode: RGB (or L) in the "
            "image_folder args to convert every image to one mode; mode: keep would stop "
            "at the first file unlike the others"
        )
    if not kept:
        return "mode: no file could be read, so none can be suggested"
    (mode,) = kept
    if mode == "RGB":
        return "mode: every file is RGB, so keep and RGB (the default) give 3 channels"
    named = f" or {mode}" if mode in IMAGE_MODES else ""
    return (
        f"mode: every file is {mode}; set mode: keep{named} to train on them as they are "
        "(without `mode`, image_folder converts them to RGB, 3 channels, and says so)"
    )


def _shapes(dataset: Any) -> dict[str, str]:
    sample = dataset[0]
    names = dataset.names or [str(i) for i in range(len(sample))]
    return {
        name: f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)} per sample"
        for name, value in zip(names, sample, strict=True)
    }


def _files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def _show(sample: Any, width: int = 100) -> str:
    from stoker.cli.data_light import is_array

    parts = sample if isinstance(sample, tuple) else (sample,)
    shown = []
    for part in parts:
        if is_array(part):  # a tensor, or a numpy array from stoker.cli.data_light
            values = ", ".join(f"{v:.4g}" for v in part.reshape(-1)[:8].tolist())
            more = "…" if math.prod(part.shape) > 8 else ""
            shown.append(f"[{values}{more}]" if part.ndim else values)
        else:
            shown.append(repr(part))
    text = ", ".join(shown)
    return text if len(text) <= width else text[: width - 1] + "…"


def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{int(value)} B"
        value /= 1024
    return f"{value:.1f} TiB"
