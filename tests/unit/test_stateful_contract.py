"""The one contract every stateful piece keeps (DESIGN principle 5).

Save mid-epoch, restore into a fresh object, and the rest of the stream is identical
to what the original would have produced; the state is plain data that
``torch.load(weights_only=True)`` accepts.
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from stoker.data.bucketing import LengthBucketBatchSampler
from stoker.data.samplers import BlockShuffleSampler, EpochRandomSampler
from stoker.data.streaming import ShardStream
from stoker.data.weighted import EpochWeightedSampler


def _shards(folder: Path) -> list[Path]:
    paths = []
    for shard in range(3):
        path = folder / f"shard-{shard}.jsonl"
        path.write_text("".join(json.dumps({"id": shard * 10 + i}) + "\n" for i in range(7)))
        paths.append(path)
    return paths


# name -> (factory(tmp_path), how many items to take before saving)
STATEFUL: dict[str, tuple[Callable[[Path], Any], int]] = {
    "random sampler": (lambda _: EpochRandomSampler(50, seed=3), 17),
    "weighted sampler": (
        lambda _: EpochWeightedSampler(torch.linspace(0.1, 1.0, 40), seed=5),
        11,
    ),
    "distributed random sampler": (
        lambda _: EpochRandomSampler(50, seed=3, rank=1, world_size=2),
        9,
    ),
    "bucketing batch sampler": (
        lambda _: LengthBucketBatchSampler(
            torch.arange(1, 81) % 17 + 1, batch_size=4, bucket_size_multiplier=3, seed=2
        ),
        6,
    ),
    "shard stream": (lambda folder: ShardStream(_shards(folder), shuffle_buffer=5, seed=1), 8),
    "block shuffle sampler": (
        lambda _: BlockShuffleSampler([0, 7, 20, 33, 50], window=2, seed=9),
        12,
    ),
}


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", list(STATEFUL))
@pytest.mark.parametrize("epoch", [0, 2])
def test_save_mid_epoch_restore_fresh_rest_identical(name: str, epoch: int, tmp_path) -> None:
    factory, taken = STATEFUL[name]
    original = factory(tmp_path)
    original.set_epoch(epoch)
    stream: Iterator[Any] = iter(original)
    head = list(itertools.islice(stream, taken))
    state = _roundtrip(original.state_dict())
    rest = list(stream)
    assert head and rest, "the contract needs items on both sides of the save"

    fresh = factory(tmp_path)
    fresh.load_state_dict(state)
    fresh.set_epoch(epoch)  # the loop selects the epoch again after loading
    assert list(fresh) == rest

    # And the next epoch after a resumed one is the same as without the interruption.
    original.set_epoch(epoch + 1)
    fresh.set_epoch(epoch + 1)
    assert list(fresh) == list(original)


# --- callbacks: the same contract, driven through their hooks --------------------------

EXAMPLE_MODELS = Path(__file__).resolve().parents[2] / "examples" / "two_heads" / "models.py"


def _example_callback(name: str, **args: Any) -> Any:
    from stoker.components import resolve_callable

    return resolve_callable(f"{EXAMPLE_MODELS}:{name}", field="test", builtins={})(**args)


class _Loop:
    """What a callback sees of the loop: counters, ``log`` and ``request_stop``."""

    def __init__(self) -> None:
        from stoker.train.state import TrainState

        self.state = TrainState()
        self.logged: list[dict[str, Any]] = []

    def log(self, metrics: dict[str, Any]) -> None:
        self.logged.append({"step": self.state.step, **metrics})

    def request_stop(self, reason: str = "") -> None:
        self.logged.append({"stop": reason})


def _drive(callbacks: Any, loop: _Loop, steps: range) -> None:
    from stoker.train.callbacks import StepRecord

    for step in steps:
        loop.state.step = step + 1
        loss = torch.tensor(1.0 / (step + 1))
        record = StepRecord(
            step=step + 1, epoch=1, batch=step + 1, loss=loss, lr=0.1,
            metrics={"train/kind_loss": loss * 0.25},
        )  # fmt: skip
        callbacks.call("on_step_end", loop, record)


CALLBACKS: dict[str, Callable[[], list[Any]]] = {
    "two-heads example LossBalance": lambda: [_example_callback("LossBalance", every=2)],
    "two of one class": lambda: [
        _example_callback("LossBalance", every=2),
        _example_callback("LossBalance", every=3),
    ],
}


@pytest.mark.parametrize("name", list(CALLBACKS))
def test_callbacks_save_mid_run_restore_fresh_rest_identical(name: str) -> None:
    from stoker.train.callbacks import Callbacks

    original, loop = Callbacks(CALLBACKS[name]()), _Loop()
    _drive(original, loop, range(7))
    state = _roundtrip(original.state_dict())
    assert state, "the contract needs a callback with state"
    loop.logged.clear()
    _drive(original, loop, range(7, 20))
    rest = loop.logged

    fresh, again = Callbacks(CALLBACKS[name]()), _Loop()
    assert fresh.load_state_dict(state) == []  # every state found its callback
    _drive(fresh, again, range(7, 20))
    assert rest and again.logged == rest
    assert fresh.state_dict() == original.state_dict()
