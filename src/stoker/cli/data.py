"""``stoker data inspect PATH`` and ``stoker data convert SRC DST``: look at and prepare data."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from stoker.data import builtins
from stoker.data.convert import convert_csv
from stoker.data.fingerprint import fingerprint_dataset, fingerprint_files
from stoker.errors import DataError


def add_parser(subparsers: argparse._SubParsersAction, *, parents: list) -> None:
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
    path = Path(args.path)
    if not path.exists():
        raise DataError(f"{path} does not exist", hint="give a file or folder of data")
    dataset, kind, schema = open_for_inspection(path)
    size = sum(f.stat().st_size for f in _files(path))
    fingerprint = fingerprint_dataset(dataset, full=args.full)
    if fingerprint.kind == "unknown":
        fingerprint = fingerprint_files(path, full=args.full)
    print(f"{path}  ({kind})")
    print(f"  samples:     {len(dataset):,}")
    print(f"  size:        {_human(size)} on disk")
    print(f"  fingerprint: {fingerprint.short} ({fingerprint.mode})")
    print("  schema:")
    for name, description in schema.items():
        print(f"    {name}: {description}")
    rows = min(args.rows, len(dataset))
    if rows:
        print(f"  first {rows} sample{'s' * (rows != 1)}:")
        for index in range(rows):
            print(f"    [{index}] {_show(dataset[index])}")
    return 0


def open_for_inspection(path: Path) -> tuple[Any, str, dict[str, str]]:
    """The dataset at ``path``, its kind, and its schema as {field: description}."""
    suffixes = {p.suffix for p in _files(path)}
    if path.suffix == ".parquet" or (path.is_dir() and suffixes == {".parquet"}):
        dataset = builtins.parquet(str(path))
        return dataset, "parquet", dataset.schema()
    if path.suffix == ".npy" or (path.is_dir() and suffixes == {".npy"}):
        dataset = builtins.npy(str(path) if path.is_dir() else [str(path)])
        return dataset, "npy", _shapes(dataset)
    if path.suffix == ".csv":
        dataset = builtins.csv(str(path))
        return dataset, "csv", {name: "column" for name in dataset.columns}
    if path.suffix == ".jsonl":
        dataset = builtins.jsonl(str(path), tokenizer="byte")
        classes = getattr(dataset, "classes", None)
        schema = {"text": "str → byte tokens", "label": f"classes {classes}" if classes else "int"}
        return dataset, "jsonl", schema
    if path.is_dir():
        dataset = builtins.image_folder(str(path))
        counts = torch.bincount(dataset.targets, minlength=len(dataset.classes)).tolist()
        schema = {
            name: f"{count} images" for name, count in zip(dataset.classes, counts, strict=True)
        }
        return dataset, "image folder", schema
    raise DataError(
        f"stoker data inspect does not know the format of {path}",
        hint="give a .parquet, .npy, .csv or .jsonl file, or a folder of them or of images",
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
    parts = sample if isinstance(sample, tuple) else (sample,)
    shown = []
    for part in parts:
        if isinstance(part, torch.Tensor):
            values = ", ".join(f"{v:.4g}" for v in part.flatten()[:8].tolist())
            more = "…" if part.numel() > 8 else ""
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
