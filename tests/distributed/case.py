"""Components for the distributed tests, loaded by the configs as `case.py:NAME`.

Faults are chosen by environment variables, so one config serves every test:
  CASE_KILL_AT_SAMPLE=N    rank CASE_RANK SIGKILLs itself after fetching N samples
                           (only in torchrun's first attempt unless CASE_KILL_ALWAYS=1)
  CASE_HANG_AT_SAMPLE=N    rank CASE_RANK sleeps for ever after fetching N samples
  CASE_SAMPLE_DELAY_S=S    every rank sleeps S seconds per sample (a run long enough to stop)
"""

from __future__ import annotations

import json
import os
import signal
import time

import torch
from torch.utils.data import Dataset, IterableDataset


def _features() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(320, 8, generator=generator)
    labels = (features[:, 0] - features[:, 1] + 0.5 * features[:, 2] > 0).long()
    return features, labels


class Samples(Dataset):
    """320 samples of 8 features and a binary label, fetched one by one."""

    def __init__(self) -> None:
        self.features, self.labels = _features()
        self.fetched = 0
        self.rank = int(os.environ.get("RANK", "0"))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.fetched += 1
        self._maybe_fail()
        time.sleep(float(os.environ.get("CASE_SAMPLE_DELAY_S", "0")))
        return self.features[index], self.labels[index]

    def _maybe_fail(self) -> None:
        if int(os.environ.get("CASE_RANK", "-1")) != self.rank:
            return
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        kill_at = int(os.environ.get("CASE_KILL_AT_SAMPLE", "0"))
        if (
            kill_at
            and self.fetched == kill_at
            and (first_attempt or os.environ.get("CASE_KILL_ALWAYS"))
        ):
            os.kill(os.getpid(), signal.SIGKILL)
        hang_at = int(os.environ.get("CASE_HANG_AT_SAMPLE", "0"))
        if hang_at and self.fetched == hang_at:
            while True:
                time.sleep(3600)


def samples() -> Dataset:
    return Samples()


def rank_sliced() -> Dataset:
    """Data a user split by rank already: each rank holds only its half."""
    data = Samples()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    keep = torch.arange(rank, len(data), world)
    data.features, data.labels = data.features[keep], data.labels[keep]
    return data


class UnevenStream(IterableDataset):
    """A stream that does not split itself evenly: rank r yields 64 + 32 r samples."""

    def __iter__(self):
        features, labels = _features()
        count = 64 + 32 * int(os.environ.get("RANK", "0"))
        for index in range(count):
            yield features[index], labels[index]


def uneven_stream() -> IterableDataset:
    return UnevenStream()


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


class WatchSaves:
    """Asynchronous checkpoint saves, watched (test_fsdp.py).

    Every rank's shard write is slowed by ``slow_s`` (so that steps run while it goes on),
    and at each step's end rank 0 checks that every checkpoint with a marker verifies,
    its shards included, and counts the steps that ended while a save was unmarked.
    ``report`` gets ``{"verified": [names], "steps": n}`` at the end.
    """

    def __init__(self, checkpoints: str, report: str, slow_s: float = 0.5) -> None:
        self.checkpoints, self.report, self.slow_s = checkpoints, report, slow_s
        self.verified: set[str] = set()
        self.steps_while_writing = 0

    def on_train_start(self, loop) -> None:
        from torch.distributed.checkpoint import FileSystemWriter

        write, slow_s = FileSystemWriter.write_data, self.slow_s

        def slow_write(writer, plan, planner):
            time.sleep(slow_s)
            return write(writer, plan, planner)

        FileSystemWriter.write_data = slow_write  # this run's processes only

    def on_step_end(self, loop, step) -> None:
        if os.environ.get("RANK") != "0":
            return
        from pathlib import Path

        from stoker.checkpoint import load_checkpoint
        from stoker.checkpoint.sharded import check_shards

        folder = Path(self.checkpoints)
        for marker in folder.glob("step-*/COMPLETE"):  # not the .tmp- one being renamed
            if marker.parent.name not in self.verified:
                files = load_checkpoint(marker.parent)["model"]["sharded_weights"]["files"]
                assert check_shards(marker.parent, files, part=(0, 1)) is None, marker
                self.verified.add(marker.parent.name)
        writing = [p for p in folder.glob(".tmp-step-*") if (p / "shards").is_dir()]
        self.steps_while_writing += bool(writing)

    def on_train_end(self, loop) -> None:
        if os.environ.get("RANK") == "0":
            summary = {"verified": sorted(self.verified), "steps": self.steps_while_writing}
            with open(self.report, "w") as out:
                json.dump(summary, out)
