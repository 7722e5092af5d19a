"""Variable-length text, side by side: stoker's length buckets vs a hand loop vs Lightning.

Corpus: docstrings of six standard-library packages (``stoker.examples.text``: real
English that ships with Python, read offline; label = the package), cut to
``--max-bytes`` UTF-8 byte tokens (``ByteTokenizer``), ``--samples`` of them (a seeded
subset; 0: all 2,184). Model: the zoo's ``TextClassifier(kind="gru")``, a bidirectional
GRU with masked mean/max pooling, the same initial weights for every contender; Adam
lr 3e-3, batch ``--batch-size``, one epoch:

- ``hand``: ``DataLoader(dataset, shuffle=True, collate_fn=pad_batch)``, the user's own
  collate padding each batch to its longest text, and the seed's loop body;
- ``stoker``: ``stoker.fit(model, dataset, sampler="bucket", collate_fn="pad")``, as a
  user configures it (``loader.sampler: bucket`` in a config): batches of similar
  lengths, so less padding for the GRU to run over;
- ``lightning``: ``Trainer.fit`` on the hand loop's DataLoader (rows say "not installed"
  when it is missing).

Timed: train time, first to last forward of the epoch, extrapolated by one step (as
trainer.py; the dataset's lengths, read once by the bucket sampler before the first
step, are in the wall time beside). Contenders alternate round by round after a
warm-up round; medians of per-round ratios; load average before and after. Target:
stoker / hand <= 1.03. The padding each contender's batches carry is shown too: the
GRU's time follows the padded tokens.

    python benchmarks/workloads_text.py --out bench-out --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Check,
    Result,
    StepStamps,
    add_common_arguments,
    info,
    interleaved,
    lightning_fit,
    lightning_status,
    lightning_version,
    median,
    paired_ratio,
    set_threads,
    table,
    target_check,
    weights_of,
)

import stoker
from stoker.data.bucketing import LengthBucketBatchSampler
from stoker.data.text import TextListDataset
from stoker.data.tokenizers import ByteTokenizer
from stoker.examples.models import TextClassifier
from stoker.examples.text import PACKAGES, stdlib_docstrings

BENCH = "workloads_text"
LR = 3e-3


def corpus(samples: int) -> tuple[list[str], list[int]]:
    """The docstrings, a seeded subset of ``samples`` of them (0: all)."""
    texts, labels = stdlib_docstrings(max_chars=None)
    if samples and samples < len(texts):
        keep = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0))[:samples]
        texts = [texts[i] for i in keep.tolist()]
        labels = [labels[i] for i in keep.tolist()]
    return texts, labels


def make_dataset(texts: list[str], labels: list[int], max_bytes: int) -> TextListDataset:
    return TextListDataset(texts, labels, tokenizer=ByteTokenizer(max_length=max_bytes))


def pad_batch(samples: list) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """What a user writes: pad to the longest text of the batch, a mask, stacked labels."""
    ids = [ids for ids, _ in samples]
    lengths = torch.tensor([len(t) for t in ids])
    input_ids = pad_sequence(ids, batch_first=True)
    mask = (torch.arange(input_ids.shape[1]) < lengths[:, None]).long()
    labels = torch.stack([label for _, label in samples])
    return {"input_ids": input_ids, "attention_mask": mask}, labels


def model_factory(hidden: int):
    """A function that builds the BiGRU classifier, every time with the same weights."""

    def new() -> nn.Module:
        return TextClassifier(
            257, len(PACKAGES), kind="gru", embed_dim=32, hidden=hidden, dropout=0.0
        )

    torch.manual_seed(0)
    init = weights_of(new())

    def build() -> nn.Module:
        model = new()
        model.load_state_dict(init)
        return model

    return build


def hand_loop(model: nn.Module, loader: DataLoader) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    for inputs, labels in loader:
        loss = loss_fn(model(**inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def padding(dataset: TextListDataset, batch_size: int) -> dict[str, float]:
    """Share of padding in bucketed batches and in random ones (one epoch each)."""
    sampler = LengthBucketBatchSampler(dataset.lengths(), batch_size=batch_size, seed=0)
    stats = sampler.padding_stats()
    return {
        "bucket": stats["padding_fraction"],
        "random": stats["random_padding_fraction"],
        "saved": stats["saved_fraction"],
    }


def ratio_info(figure: str, values: dict[str, list[float]], name: str) -> Check:
    """``name`` / hand, the median of per-round ratios (no target)."""
    return info(BENCH, figure, paired_ratio(values[name], values["hand"]), unit="x")


def text_benchmark(
    texts: list[str],
    labels: list[int],
    *,
    rounds: int,
    batch_size: int,
    max_bytes: int,
    hidden: int,
) -> tuple[dict, list[Check]]:
    build = model_factory(hidden)
    shared = make_dataset(texts, labels, max_bytes)
    root = Path(tempfile.mkdtemp(prefix="stoker-text-"))

    def hand_loader() -> DataLoader:
        return DataLoader(shared, batch_size=batch_size, shuffle=True, collate_fn=pad_batch)

    def timed(run):
        def one() -> dict[str, float]:
            model = build()
            stamps = StepStamps(model, cpu=True)
            started = time.perf_counter()
            run(model)
            wall = time.perf_counter() - started
            stamps.remove()
            return {
                "train_s": stamps.span_s(),
                "cpu_s": stamps.cpu_span_s(),
                "wall_s": wall,
                "steps": len(stamps.stamps),
            }

        return one

    def fit(model: nn.Module) -> None:
        stoker.fit(
            model,
            make_dataset(texts, labels, max_bytes),  # fresh: its lengths are read in the run
            epochs=1,
            batch_size=batch_size,
            sampler="bucket",
            collate_fn="pad",
            optimizer="adam",
            lr=LR,
            threads=torch.get_num_threads(),
            seed=0,
            progress="quiet",
            tensorboard=False,
            enabled=False,
            run_dir=tempfile.mkdtemp(dir=root),
        )

    contenders = {
        "hand": timed(lambda m: hand_loop(m, hand_loader())),
        "stoker": timed(fit),
    }
    skip_lightning = lightning_status()
    if not skip_lightning:
        contenders["lightning"] = timed(
            lambda m: lightning_fit(m, hand_loader(), 1, lambda p: torch.optim.Adam(p, lr=LR))
        )
    records = interleaved(contenders, rounds=rounds)
    train = {name: [r["train_s"] for r in rs] for name, rs in records.items()}
    wall = {name: [r["wall_s"] for r in rs] for name, rs in records.items()}
    cpu = {name: [r["cpu_s"] for r in rs] for name, rs in records.items()}
    pads = padding(shared, batch_size)
    checks = [
        info(BENCH, f"text: {name} train time, one epoch", median(values), unit="s")
        for name, values in train.items()
    ]
    checks.append(
        target_check(
            BENCH,
            "text: stoker (bucket + pad) / hand loop, train time",
            paired_ratio(train["stoker"], train["hand"]),
            "<=",
            1.03,
            note=f"padding {pads['bucket']:.0%} of bucketed tokens vs {pads['random']:.0%} "
            "of random batches",
        )
    )
    checks.append(ratio_info("text: stoker / hand loop, CPU time", cpu, "stoker"))
    for figure, values in (("train time", train), ("CPU time", cpu)):
        name = f"text: lightning / hand loop, {figure}"
        if skip_lightning:
            checks.append(Check(BENCH, name, None, status=skip_lightning))
        else:
            checks.append(ratio_info(name, values, "lightning"))
    checks.append(
        ratio_info("text: stoker / hand loop, wall time (incl. start-up)", wall, "stoker")
    )
    figures = {"train_s": train, "cpu_s": cpu, "wall_s": wall, "padding": pads}
    return {**figures, "samples": len(texts)}, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser)
    parser.add_argument("--samples", type=int, default=0, help="texts (0: all 2,184)")
    parser.add_argument("--max-bytes", type=int, default=256, help="tokens kept per text")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64, help="GRU width")
    args = parser.parse_args()
    set_threads(args.threads)
    rounds = args.rounds or 3
    texts, labels = corpus(args.samples)  # parsing the stdlib: not timed
    load_before = os.getloadavg()[0]
    figures, checks = text_benchmark(
        texts,
        labels,
        rounds=rounds,
        batch_size=args.batch_size,
        max_bytes=args.max_bytes,
        hidden=args.hidden,
    )
    checks.append(info(BENCH, "load average 1 min before", load_before))
    checks.append(info(BENCH, "load average 1 min after", os.getloadavg()[0]))
    print(table(checks))
    result = Result(
        benchmark=BENCH,
        timed="train time: first to last forward of one epoch, extrapolated by one step",
        workload={
            "corpus": "stdlib docstrings, byte tokens",
            "samples": len(texts),
            "max_bytes": args.max_bytes,
            "batch_size": args.batch_size,
            "model": f"TextClassifier(kind='gru', embed_dim=32, hidden={args.hidden})",
            "optimizer": f"Adam lr {LR:g}",
            "threads": args.threads,
            "rounds": rounds,
            "lightning": lightning_version(),
        },
        figures=figures,
        checks=checks,
    )
    print(f"wrote {result.write(args.out)}")


if __name__ == "__main__":
    main()
