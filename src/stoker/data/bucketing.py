"""Length-bucketing batch sampler: batches of similar lengths, so less padding; resumable."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from stoker.data.samplers import EpochPosition, epoch_seed, rank_and_world_size
from stoker.data.sources import dataset_lengths, innermost
from stoker.errors import ConfigError, DataError

__all__ = ["LengthBucketBatchSampler", "bucket_lengths"]

# epoch_seed streams: the batch order, and the random batches padding_stats compares with.
_BATCH_ORDER_STREAM = 2
_RANDOM_BATCHES_STREAM = 3


def _validate_lengths(lengths: Any) -> torch.Tensor:
    try:
        t = torch.as_tensor(
            np.asarray(lengths) if not isinstance(lengths, torch.Tensor) else lengths
        )
    except (TypeError, ValueError, RuntimeError) as error:
        raise DataError(
            f"sequence lengths of type {type(lengths).__name__} do not convert to integers.",
            hint="pass one int per sample, e.g. [len(tokens) for tokens in texts]",
        ) from error
    if t.dim() != 1 or t.numel() == 0:
        raise DataError(
            f"sequence lengths have shape {tuple(t.shape)}; expected a non-empty 1-D array "
            "with one length per sample.",
            hint="pass one int per sample, e.g. [len(tokens) for tokens in texts]",
        )
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise DataError(
            f"sequence lengths have dtype {t.dtype}; expected integers.",
            hint="convert them, e.g. lengths.long()",
        )
    negative = (t < 0).nonzero()
    if negative.numel():
        i = int(negative[0])
        raise DataError(
            f"sequence length at index {i} is {int(t[i])}; expected lengths >= 0.",
            hint="check how the lengths were computed",
        )
    return t.to(dtype=torch.long, device="cpu")


def bucket_lengths(dataset: Dataset[Any]) -> torch.Tensor:
    """The per-sample lengths ``loader.sampler=bucket`` groups ``dataset`` by.

    From the dataset's ``lengths()``; for the training part of a ``val_fraction`` split
    (a ``Subset``) or a cached dataset, from the wrapped dataset's, at the part's indices.

    Raises:
        ConfigError: The dataset declares no lengths; the hint says how to give them, or
            to use another sampler where stoker's own dataset has none to give.
        DataError: Lengths that are not one integer >= 0 per sample.
    """
    inner, indices, name = innermost(dataset)
    lengths = dataset_lengths(inner)
    if lengths is None:
        if type(inner).__module__.startswith("stoker."):
            # stoker's own sources without lengths hold fixed-size samples (rows, images).
            hint = (
                f"{type(inner).__name__} has no lengths to bucket by (its samples have a "
                "fixed size): set loader.sampler=random (or auto)"
            )
        else:
            hint = (
                f"add a lengths() method to {type(inner).__name__} returning one int per "
                "sample, without loading the samples (e.g. `return torch.tensor([len(t) "
                "for t in self.texts])`), or set loader.sampler=random"
            )
        raise ConfigError(
            f"loader.sampler=bucket needs per-sample lengths, but {name} has no lengths() method.",
            hint=hint,
        )
    checked = _validate_lengths(lengths)
    count = len(inner)  # type: ignore[arg-type]
    if checked.numel() != count:
        raise DataError(
            f"{type(inner).__name__}.lengths() gave {checked.numel()} lengths for its "
            f"{count} samples; expected one length per sample.",
            hint=f"return one length per sample of {type(inner).__name__}, in index order",
        )
    # A split's training part: the lengths of its samples, none of them read again.
    return checked if indices is None else checked[indices]


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{name} must be an int >= 1; got {value!r}.",
            hint=f"set {name} to a positive int",
        )
    return value


def _padded_tokens(
    lengths: torch.Tensor,
    batches: list[torch.Tensor],
    *,
    max_length: int | None,
    pad_to_multiple_of: int | None,
) -> tuple[int, int]:
    """Real tokens and the tokens of the padded batches (as pad_collate pads them)."""
    real = padded = 0
    for batch in batches:
        sizes = lengths[batch]
        if max_length is not None:
            sizes = sizes.clamp(max=max_length)
        width = int(sizes.max())
        if pad_to_multiple_of:
            width = math.ceil(width / pad_to_multiple_of) * pad_to_multiple_of
        real += int(sizes.sum())
        padded += width * batch.numel()
    return real, padded


class LengthBucketBatchSampler(Sampler[list[int]]):
    """Batches of samples with similar lengths, to cut the padding of variable-length data.

    Per epoch: shuffle all indices (seeded by ``(seed, epoch)``), cut them into buckets
    of ``batch_size * bucket_size_multiplier``, sort each bucket by length, cut it into
    batches, and shuffle the order of the batches. Within a bucket, batches hold
    samples of similar length; across the epoch, batches still come in random order.
    Only the last batch of the epoch can be short (dropped with ``drop_last``).

    Distributed: every rank computes the same batches and takes every
    ``world_size``-th from its rank on. The batch list is first evened out to a
    multiple of ``world_size`` by repeating its first batches (or, with
    ``drop_last``, dropping its last), so every rank runs the same number of steps.

    Pass it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=PadCollate())``.
    It works on the lengths alone and never reads the data.

    Mid-epoch resume: ``state_dict()`` records the batches this pass handed out, and
    after :meth:`load_state_dict` the next pass of that epoch skips them (a DataLoader
    with workers draws batches ahead of those delivered; with ``num_workers=0`` the
    count is exact). Resume with the same lengths, batch size and world size.
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        *,
        batch_size: int,
        bucket_size_multiplier: int = 50,
        shuffle: bool = True,
        drop_last: bool = False,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """Build the sampler.

        Args:
            lengths: One sequence length per sample of the dataset.
            batch_size: Samples per batch.
            bucket_size_multiplier: A bucket holds this many batches. Larger buckets
                give less padding and less randomness.
            shuffle: Shuffle indices and batch order each epoch; without it, indices
                are bucketed in dataset order and batches come in bucket order.
            drop_last: Drop a short last batch, and with several ranks the batches
                that do not divide evenly among them (instead of repeating some).
            seed: Base seed, mixed with the epoch; the same on every rank.
            rank: This process's rank; defaults to torch.distributed's, else 0.
            world_size: Number of ranks; defaults to torch.distributed's, else 1.

        Raises:
            DataError: Lengths that are not a non-empty 1-D array of integers >= 0.
            ConfigError: A batch size or multiplier below 1, or a bad rank or world size.
        """
        self.lengths = _validate_lengths(lengths)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.bucket_size_multiplier = _positive_int(
            "bucket_size_multiplier", bucket_size_multiplier
        )
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed)
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
        self.epoch = 0
        self._position = EpochPosition()

    @property
    def batches_yielded(self) -> int:
        """Batches handed out by the current (or last) pass of this epoch."""
        return self._position.yielded

    def set_epoch(self, epoch: int) -> None:
        """Select the batches of ``epoch``; a different epoch starts from its beginning."""
        if int(epoch) != self.epoch:
            self._position.reset()
        self.epoch = int(epoch)

    def _global_batches(self) -> list[torch.Tensor]:
        """All ranks' batches of this epoch, in order, before the split among ranks."""
        n = self.lengths.numel()
        generator = torch.Generator().manual_seed(epoch_seed(self.seed, self.epoch))
        order = torch.randperm(n, generator=generator) if self.shuffle else torch.arange(n)
        bucket = self.batch_size * self.bucket_size_multiplier
        batches: list[torch.Tensor] = []
        for chunk in torch.split(order, bucket):
            # Stable, so equal lengths keep their shuffled order.
            by_length = torch.sort(self.lengths[chunk], stable=True).indices
            batches.extend(torch.split(chunk[by_length], self.batch_size))
        if self.drop_last and batches[-1].numel() < self.batch_size:
            batches.pop()
        if self.shuffle and batches:
            generator.manual_seed(epoch_seed(self.seed, self.epoch, stream=_BATCH_ORDER_STREAM))
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator)]
        return batches

    def _rank_batches(self) -> list[torch.Tensor]:
        batches = self._global_batches()
        count, world = len(batches), self.world_size
        if world == 1 or not count:
            return batches
        if self.drop_last:
            batches = batches[: count // world * world]
        elif count % world:
            missing = world - count % world
            batches = batches + (batches * math.ceil(missing / count))[:missing]
        return batches[self.rank :: world]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._rank_batches()
        start = self._position.begin()
        for batch in batches[start:]:
            self._position.yielded += 1
            yield batch.tolist()

    def __len__(self) -> int:
        n = self.lengths.numel()
        count = n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        if self.drop_last:
            return count // self.world_size
        return math.ceil(count / self.world_size)

    def skip(self, count: int) -> None:
        """Make the next pass start after this epoch's first ``count`` batches (unread)."""
        self._position.restore(min(max(int(count), 0), len(self)))

    def state_dict(self) -> dict[str, int]:
        """What resumes this sampler: ``{"epoch", "batches_yielded", "world_size"}``."""
        return {
            "epoch": self.epoch,
            "batches_yielded": self._position.yielded,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; the next pass continues where that one stopped."""
        count = int(state.get("batches_yielded", 0))
        saved_world = int(state.get("world_size", self.world_size))
        if count and saved_world != self.world_size:
            raise ConfigError(
                f"LengthBucketBatchSampler state was saved mid-epoch with world_size="
                f"{saved_world}, but this run has world_size={self.world_size}.",
                hint="resume with the same number of processes, or set batches_yielded=0 "
                "in the state to restart the epoch",
            )
        if not 0 <= count <= len(self):
            raise ConfigError(
                f"LengthBucketBatchSampler state has batches_yielded={count}, but an epoch "
                f"has {len(self)} batches on this rank.",
                hint="load the state this sampler's state_dict() returned, with the same "
                "lengths and batch_size",
            )
        self.epoch = int(state["epoch"])
        self._position.restore(count)

    def padding_stats(
        self, *, max_length: int | None = None, pad_to_multiple_of: int | None = None
    ) -> dict[str, float | int]:
        """How much padding this epoch's batches carry, beside random batches of the same size.

        Counted over all ranks' batches of the current epoch (before the distributed
        split), with sequences cut at ``max_length`` and batches padded to a multiple
        of ``pad_to_multiple_of``, as :func:`~stoker.data.collate.pad_collate` does.

        Returns:
            ``padding_fraction`` (pad tokens / all tokens of the padded batches),
            ``random_padding_fraction`` (the same for a random split into batches),
            ``saved_fraction`` (share of the random batches' tokens these batches do
            not need), and the counts ``tokens``, ``padded_tokens``,
            ``random_padded_tokens``.
        """
        batches = self._global_batches()
        generator = torch.Generator().manual_seed(
            epoch_seed(self.seed, self.epoch, stream=_RANDOM_BATCHES_STREAM)
        )
        random_batches = list(
            torch.split(torch.randperm(self.lengths.numel(), generator=generator), self.batch_size)
        )
        if self.drop_last and random_batches[-1].numel() < self.batch_size:
            random_batches.pop()
        options = {"max_length": max_length, "pad_to_multiple_of": pad_to_multiple_of}
        real, padded = _padded_tokens(self.lengths, batches, **options)
        random_real, random_padded = _padded_tokens(self.lengths, random_batches, **options)
        return {
            "padding_fraction": (padded - real) / padded if padded else 0.0,
            "random_padding_fraction": (
                (random_padded - random_real) / random_padded if random_padded else 0.0
            ),
            "saved_fraction": 1 - padded / random_padded if random_padded else 0.0,
            "tokens": real,
            "padded_tokens": padded,
            "random_padded_tokens": random_padded,
        }
