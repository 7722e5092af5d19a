"""Collate functions: pure functions from what a dataset returns to one batch."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from torch.utils.data import default_collate

from stoker.errors import ConfigError, DataError

__all__ = ["PadCollate", "PadSide", "default_collate", "pad_collate", "passthrough", "token_count"]

T = TypeVar("T")
PadSide = Literal["right", "left"]

# CrossEntropyLoss's default ignore_index: padded label positions add nothing to the loss.
LABEL_PAD = -100


def passthrough(batch: T) -> T:
    """Return ``batch`` unchanged.

    The collate function for datasets whose ``__getitems__`` already returns a
    collated batch (``returns_batches = True``), so no per-sample work is done.
    """
    return batch


def _is_sequence(value: Any) -> bool:
    """A value padded along its first dimension: a tensor of rank >= 1 or a list/tuple of them."""
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1
    return isinstance(value, list | tuple)


def _as_tensor(value: Any, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        # Token ids come as Python ints; keep them int64 (what nn.Embedding takes).
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as error:
        raise DataError(
            f"{where} is a {type(value).__name__} that does not convert to a tensor.",
            hint="return token ids as a list of ints or a 1-D LongTensor",
        ) from error


def _target_length(
    lengths: list[int], *, max_length: int | None, pad_to_multiple_of: int | None
) -> int:
    width = max(lengths)
    if max_length is not None:
        width = min(width, max_length)
    if pad_to_multiple_of:
        width = math.ceil(width / pad_to_multiple_of) * pad_to_multiple_of
    return width


def _pad(
    values: Sequence[Any],
    *,
    where: str,
    pad_value: float,
    side: PadSide,
    max_length: int | None,
    pad_to_multiple_of: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pads (and truncates) sequences along their first dimension; returns them and lengths."""
    tensors = [_as_tensor(v, f"{where} of sample {i}") for i, v in enumerate(values)]
    rest = tensors[0].shape[1:]
    for i, t in enumerate(tensors):
        if t.dim() == 0 or t.shape[1:] != rest:
            raise DataError(
                f"{where} of sample {i} has shape {tuple(t.shape)}; expected a sequence of "
                f"shape (length, *{tuple(rest)}) like sample 0.",
                hint="give every sample's sequence the same trailing dimensions",
            )
    # Truncation follows the padding side: right padding keeps the start of a sequence,
    # left padding (decoder prompts, generation continues at the end) keeps its end.
    if max_length is not None:
        tensors = [
            t[:max_length] if side == "right" else t[max(t.shape[0] - max_length, 0) :]
            for t in tensors
        ]
    lengths = [t.shape[0] for t in tensors]
    width = _target_length(lengths, max_length=max_length, pad_to_multiple_of=pad_to_multiple_of)
    out = torch.full((len(tensors), width, *rest), pad_value, dtype=tensors[0].dtype)
    for row, (t, n) in enumerate(zip(tensors, lengths, strict=True)):
        target = out[row, :n] if side == "right" else out[row, width - n :]
        target.copy_(t)
    return out, torch.tensor(lengths, dtype=torch.long)


def _mask(lengths: torch.Tensor, width: int, side: PadSide) -> torch.Tensor:
    positions = torch.arange(width)
    if side == "right":
        return (positions < lengths[:, None]).long()
    return (positions >= (width - lengths)[:, None]).long()


def _collate_field(
    key: str,
    values: list[Any],
    *,
    pad_value: float,
    options: dict[str, Any],
    always_pad: bool,
) -> Any:
    """Stacks a field whose samples agree in shape; pads it when they vary (or always_pad)."""
    if all(_is_sequence(v) for v in values):
        try:
            tensors = [_as_tensor(v, f"{key} of sample {i}") for i, v in enumerate(values)]
        except DataError:
            return list(values)  # not numbers (e.g. lists of words): kept as they came
        if always_pad or len({t.shape for t in tensors}) > 1:
            return _pad(tensors, where=key, pad_value=pad_value, **options)[0]
        return torch.stack(tensors)
    return default_collate(values)


def _check_options(side: Any, max_length: Any, pad_to_multiple_of: Any) -> None:
    if side not in ("right", "left"):
        raise ConfigError(
            f"pad side={side!r}; expected 'right' or 'left'.",
            hint="use side='right' for encoders, side='left' for decoder prompts",
        )
    for name, value, minimum in (
        ("max_length", max_length, 0),
        ("pad_to_multiple_of", pad_to_multiple_of, 1),
    ):
        bad = isinstance(value, bool) or not isinstance(value, int) or value < minimum
        if value is not None and bad:
            raise ConfigError(
                f"{name}={value!r}; expected an int >= {minimum} or None.",
                hint=f"pass {name}=None to turn it off",
            )
    if max_length is not None and pad_to_multiple_of and max_length % pad_to_multiple_of:
        raise ConfigError(
            f"max_length={max_length} is not a multiple of pad_to_multiple_of="
            f"{pad_to_multiple_of}, so a full batch would be padded past max_length.",
            hint=f"set max_length to a multiple of {pad_to_multiple_of}, e.g. "
            f"{max_length // pad_to_multiple_of * pad_to_multiple_of or pad_to_multiple_of}",
        )


def pad_collate(
    samples: Sequence[Any],
    *,
    pad_value: float = 0,
    side: PadSide = "right",
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
    sequence_key: str = "input_ids",
    pad_values: Mapping[str, float] | None = None,
    pad_keys: Sequence[str] = ("labels",),
) -> Any:
    """Pads variable-length sequences into one batch with an attention mask.

    Three sample shapes are understood:

    - a sequence alone (a 1-D tensor or a list of ints) →
      ``{"input_ids": [B, T], "attention_mask": [B, T]}``;
    - a tuple ``(sequence, label, *extra)`` → ``(inputs, labels, *extra)`` where
      ``inputs`` is that dict and labels and extras are stacked (padded if their
      lengths vary);
    - a dict with the sequence under ``sequence_key`` → the same dict with each field
      stacked (fields whose lengths vary, and those in ``pad_keys``, padded the same
      way), plus ``attention_mask`` and ``lengths`` (real lengths, int64 ``[B]``).

    The mask is int64, 1 on real tokens and 0 on padding. A sequence may have
    trailing dimensions (``[L, D]`` features); it is padded along its first.

    Truncation follows the padding side: right padding keeps the first
    ``max_length`` tokens, left padding (for decoder prompts) keeps the last.

    Args:
        samples: The samples of one batch.
        pad_value: Value of padding positions in the sequence and in other fields.
        side: Where padding goes: ``right`` or ``left``.
        max_length: Truncate longer sequences to this length.
        pad_to_multiple_of: Round the padded length up to a multiple of this (8 suits
            tensor cores); ``max_length`` must then be a multiple of it.
        sequence_key: The field holding the sequence in dict samples.
        pad_values: Padding value per dict field; ``labels`` defaults to -100
            (``CrossEntropyLoss``'s ``ignore_index``).
        pad_keys: Dict fields always padded, even in a batch where their lengths agree,
            so that token-aligned fields keep the sequence's padded length.

    Returns:
        The batch, shaped as described above.

    Raises:
        DataError: An empty batch, a dict sample without ``sequence_key``, or a
            sequence that is not one.
        ConfigError: Invalid options.
    """
    _check_options(side, max_length, pad_to_multiple_of)
    if not samples:
        raise DataError("pad_collate got an empty batch.", hint="check the sampler and dataset")
    options = {"side": side, "max_length": max_length, "pad_to_multiple_of": pad_to_multiple_of}
    first = samples[0]
    if isinstance(first, Mapping):
        return _collate_dicts(samples, pad_value, options, sequence_key, pad_values, pad_keys)
    if isinstance(first, tuple):
        sequences = [s[0] for s in samples]
        inputs, _ = _inputs(sequences, pad_value, options, where="element 0")
        rest = [
            _collate_field(
                f"element {i}",
                [s[i] for s in samples],
                pad_value=LABEL_PAD if i == 1 else pad_value,
                options=options,
                always_pad=False,
            )
            for i in range(1, len(first))
        ]
        return (inputs, *rest)
    return _inputs(list(samples), pad_value, options, where="sequence")[0]


def _inputs(
    sequences: list[Any], pad_value: float, options: dict[str, Any], *, where: str
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids, lengths = _pad(sequences, where=where, pad_value=pad_value, **options)
    mask = _mask(lengths, ids.shape[1], options["side"])
    return {"input_ids": ids, "attention_mask": mask}, lengths


def _collate_dicts(
    samples: Sequence[Mapping[str, Any]],
    pad_value: float,
    options: dict[str, Any],
    sequence_key: str,
    pad_values: Mapping[str, float] | None,
    pad_keys: Sequence[str],
) -> dict[str, Any]:
    missing = [i for i, s in enumerate(samples) if sequence_key not in s]
    if missing:
        raise DataError(
            f"dict sample {missing[0]} has no {sequence_key!r} field (keys: "
            f"{sorted(samples[missing[0]])}); pad_collate pads that field.",
            hint="pass sequence_key= the name of the token field",
        )
    values = {"labels": LABEL_PAD, **(pad_values or {})}
    inputs, lengths = _inputs(
        [s[sequence_key] for s in samples],
        values.get(sequence_key, pad_value),
        options,
        where=f"field {sequence_key!r}",
    )
    batch: dict[str, Any] = {}
    for key in samples[0]:
        if key == sequence_key:
            batch[key] = inputs["input_ids"]
        elif key == "attention_mask":
            # A mask the dataset made (e.g. with holes) is kept; padding is masked out.
            batch[key] = _pad(
                [s[key] for s in samples], where=f"field {key!r}", pad_value=0, **options
            )[0]
        else:
            batch[key] = _collate_field(
                f"field {key!r}",
                [s[key] for s in samples],
                pad_value=values.get(key, pad_value),
                options=options,
                always_pad=key in pad_keys,
            )
    batch.setdefault("attention_mask", inputs["attention_mask"])
    batch["lengths"] = lengths
    return batch


@dataclass(frozen=True)
class PadCollate:
    """:func:`pad_collate` with its options bound: ``collate_fn=PadCollate(max_length=128)``.

    A frozen dataclass, so it pickles to worker processes (a lambda would not). Its fields
    are :func:`pad_collate`'s keyword arguments, with the same defaults: ``pad_value``,
    ``side``, ``max_length``, ``pad_to_multiple_of``, ``sequence_key``, ``pad_values`` and
    ``pad_keys``.
    """

    pad_value: float = 0
    side: PadSide = "right"
    max_length: int | None = None
    pad_to_multiple_of: int | None = None
    sequence_key: str = "input_ids"
    pad_values: Mapping[str, float] | None = None
    pad_keys: tuple[str, ...] = ("labels",)

    def __post_init__(self) -> None:
        _check_options(self.side, self.max_length, self.pad_to_multiple_of)

    def __call__(self, samples: Sequence[Any]) -> Any:
        """``pad_collate`` with this object's settings (an object, so workers can pickle it)."""
        return pad_collate(
            samples,
            pad_value=self.pad_value,
            side=self.side,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            sequence_key=self.sequence_key,
            pad_values=self.pad_values,
            pad_keys=self.pad_keys,
        )


def token_count(batch: Any) -> int:
    """The number of real (unpadded) tokens in a padded batch: the sum of its mask.

    Call it on the batch before it moves to the GPU: on a CUDA tensor the ``int()``
    waits for the device (a CPU–GPU sync).

    Raises:
        DataError: The batch holds no ``attention_mask``.
    """
    inputs = batch[0] if isinstance(batch, tuple | list) and batch else batch
    if not isinstance(inputs, Mapping) or "attention_mask" not in inputs:
        raise DataError(
            f"token_count needs a batch with an 'attention_mask'; got a {type(batch).__name__}.",
            hint="collate with pad_collate / PadCollate",
        )
    return int(inputs["attention_mask"].sum())
