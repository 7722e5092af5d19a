"""Tests for stoker.data.streaming: shard streams split over ranks and workers, evened, resumed."""

from __future__ import annotations

import itertools
import json
import logging
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from stoker.data import streaming
from stoker.data.streaming import ShardStream
from stoker.errors import ConfigError, DataError


def flat(lists) -> list[int]:
    return list(itertools.chain.from_iterable(lists))


def write_shards(folder: Path, sizes: list[int]) -> list[Path]:
    """JSONL shards of ``{"id": n}``, numbered across shards in order."""
    paths, n = [], 0
    for i, size in enumerate(sizes):
        path = folder / f"shard-{i:02d}.jsonl"
        lines = [json.dumps({"id": n + k}) for k in range(size)]
        path.write_text("\n".join(lines) + "\n" if lines else "")
        paths.append(path)
        n += size
    return paths


def ids(samples) -> list[int]:
    return [s["id"] if isinstance(s, dict) else int(s) for s in samples]


def load(stream: ShardStream, **options) -> list:
    """Everything a DataLoader yields; quiet about more workers than this machine's CPUs."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This DataLoader will create", UserWarning)
        return list(DataLoader(stream, **options))


def per_worker(stream: ShardStream, monkeypatch, workers: int) -> list[list[int]]:
    """What each of ``workers`` DataLoader workers would yield, in this process."""
    out = []
    for worker in range(workers):
        info = SimpleNamespace(id=worker, num_workers=workers)
        monkeypatch.setattr(streaming, "get_worker_info", lambda info=info: info)
        out.append(ids(stream))
    monkeypatch.setattr(streaming, "get_worker_info", get_worker_info)
    return out


def test_two_ranks_three_real_workers_see_every_sample_once(tmp_path: Path) -> None:
    write_shards(tmp_path, [4] * 6)
    pattern = str(tmp_path / "shard-*.jsonl")
    seen = []
    for rank in range(2):
        stream = ShardStream(pattern, rank=rank, world_size=2, num_workers=3)
        assert stream.split_mode == "shard"
        got = ids(load(stream, batch_size=None, num_workers=3))
        assert len(got) == 12
        # Rank r reads shards r, r + 2, r + 4 (one per worker).
        assert sorted(got) == [
            n for shard in range(rank, 6, 2) for n in range(4 * shard, 4 * shard + 4)
        ]
        seen += got
    assert sorted(seen) == list(range(24))


def test_uneven_shards_are_dropped_or_padded_to_equal_ranks(tmp_path: Path, monkeypatch) -> None:
    # 2 ranks x 3 workers: rank 0 reads shards 0, 6 | 2 | 4 = 13 + 7 + 6 = 26 samples,
    # rank 1 reads shards 1, 7 | 3 | 5 = 4 + 4 + 2 = 10.
    paths = write_shards(tmp_path, [5, 3, 7, 4, 6, 2, 8, 1])
    share = {1: {5, 6, 7, 15, 16, 17, 18, 25, 26, 35}}
    share[0] = set(range(36)) - share[1]

    drop = [ShardStream(paths, rank=r, world_size=2, num_workers=3) for r in range(2)]
    got = [flat(per_worker(s, monkeypatch, 3)) for s in drop]
    assert [len(g) for g in got] == [10, 10]
    assert [s.dropped_samples for s in drop] == [16, 0]
    assert [s.padded_samples for s in drop] == [0, 0]
    assert sorted(got[1]) == sorted(share[1])
    assert set(got[0]) <= share[0] and len(set(got[0])) == 10

    pad = [ShardStream(paths, rank=r, world_size=2, num_workers=3, uneven="pad") for r in range(2)]
    workers = [per_worker(s, monkeypatch, 3) for s in pad]
    got = [flat(w) for w in workers]
    assert [len(g) for g in got] == [26, 26] == [len(s) for s in pad]
    assert [s.padded_samples for s in pad] == [0, 16]
    assert set(got[0]) == share[0] and set(got[1]) == share[1]
    # Padding repeats a worker's own stream from its start: worker 2 of rank 1 reads
    # shard 5 (ids 25, 26) and is raised to the level of the others.
    assert [len(w) for w in workers[1]] == [9, 9, 8]
    assert workers[1][2] == [25, 26, 25, 26, 25, 26, 25, 26]


def test_batch_size_gives_every_worker_whole_batches(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [5, 3, 7, 4, 6, 2, 8, 1])
    # 2 ranks x 2 workers: rank 0's workers read 5 + 6 and 7 + 8 samples, rank 1's 3 + 2
    # and 4 + 1: rounded to batches of 4, rank 0 has 3 + 4 (2 + 3 whole), rank 1 2 + 2 (1 + 1).
    for uneven, batches in (("pad", 7), ("drop", 2)):
        counts = []
        for rank in range(2):
            stream = ShardStream(
                paths, rank=rank, world_size=2, uneven=uneven, batch_size=4, num_workers=2
            )
            sizes = [len(b["id"]) for b in load(stream, batch_size=4, num_workers=2)]
            assert set(sizes) == {4}, (uneven, sizes)
            counts.append(len(sizes))
        assert counts == [batches, batches]


def test_fewer_shards_than_slots_split_by_sample(tmp_path: Path, monkeypatch, caplog) -> None:
    paths = write_shards(tmp_path, [7, 5])
    seen = []
    with caplog.at_level(logging.WARNING, logger="stoker"):
        for rank in range(2):
            stream = ShardStream(paths, rank=rank, world_size=2, num_workers=3)
            assert stream.split_mode == "sample"
            got = per_worker(stream, monkeypatch, 3)
            # Rank r keeps samples r, r + 2, ...; its workers deal those out in turn.
            assert got == [[rank, rank + 6], [rank + 2, rank + 8], [rank + 4, rank + 10]]
            seen += flat(got)
    assert sorted(seen) == list(range(12))
    assert "every worker reads every shard" in caplog.text


def test_fewer_shards_than_slots_with_a_real_loader(tmp_path: Path) -> None:
    write_shards(tmp_path, [5, 4])
    stream = ShardStream(str(tmp_path / "*.jsonl"), rank=0, world_size=1, num_workers=2)
    assert stream.split_mode == "shard"  # 2 shards for 2 slots
    stream = ShardStream(str(tmp_path / "*.jsonl"), rank=0, world_size=1, num_workers=3)
    assert stream.split_mode == "sample"
    assert sorted(ids(load(stream, batch_size=None, num_workers=3))) == list(range(9))


def test_shuffle_buffer_is_seeded_per_epoch(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [10] * 4)
    first = ids(ShardStream(paths, shuffle_buffer=8, seed=1))
    assert sorted(first) == list(range(40)) and first != list(range(40))
    assert ids(ShardStream(paths, shuffle_buffer=8, seed=1)) == first
    assert ids(ShardStream(paths, shuffle_buffer=8, seed=2)) != first
    later = ShardStream(paths, shuffle_buffer=8, seed=1)
    later.set_epoch(1)
    second = ids(later)
    assert sorted(second) == list(range(40)) and second != first


@pytest.mark.parametrize("shuffle_buffer", [0, 6])
@pytest.mark.parametrize("where", ["start", "middle", "padding", "end"])
def test_resume_continues_with_exactly_the_rest(
    tmp_path: Path, shuffle_buffer: int, where: str
) -> None:
    paths = write_shards(tmp_path, [5, 3, 7, 4, 2])

    def make(rank: int) -> ShardStream:
        stream = ShardStream(
            paths, rank=rank, world_size=2, shuffle_buffer=shuffle_buffer, uneven="pad", seed=9
        )
        stream.set_epoch(2)
        stream.count_lengths()
        return stream

    # The rank with the smaller share repeats samples; resume inside the repeats too.
    rank = max((0, 1), key=lambda r: make(r).padded_samples or 0)
    stream = make(rank)
    expected = ids(make(rank))
    total, padded = len(stream), stream.padded_samples
    assert len(expected) == total and padded is not None and padded >= 2
    take = {"start": 0, "middle": 3, "padding": total - padded + 1, "end": total}[where]
    head = ids(itertools.islice(iter(stream), take))
    state = stream.state_dict()
    assert state == {"epoch": 2, "samples_yielded": [take] if take else [], "world_size": 2}
    fresh = ShardStream(
        paths, rank=rank, world_size=2, shuffle_buffer=shuffle_buffer, uneven="pad", seed=9
    )
    fresh.load_state_dict(state)
    assert head + ids(fresh) == expected
    assert ids(fresh) == expected  # the position is used once


def test_resume_through_a_single_process_loader(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [6, 6, 6])
    expected = ids(ShardStream(paths, shuffle_buffer=4))
    stream = ShardStream(paths, shuffle_buffer=4)
    batches = iter(DataLoader(stream, batch_size=4, num_workers=0))
    head = [n for _ in range(2) for n in next(batches)["id"].tolist()]
    fresh = ShardStream(paths, shuffle_buffer=4)
    fresh.load_state_dict(stream.state_dict())
    rest = [n for b in DataLoader(fresh, batch_size=4) for n in b["id"].tolist()]
    assert head + rest == expected


def test_worker_positions_resume_per_worker(tmp_path: Path, monkeypatch) -> None:
    paths = write_shards(tmp_path, [3, 3, 3])
    full = per_worker(ShardStream(paths), monkeypatch, 3)
    stream = ShardStream(paths)
    stream.load_state_dict({"epoch": 0, "samples_yielded": [2, 0, 1], "world_size": 1})
    assert full == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert per_worker(stream, monkeypatch, 3) == [[2], [3, 4, 5], [7, 8]]
    # The main process of a loader with workers records the epoch start: exact there.
    fresh = ShardStream(paths)
    fresh.load_state_dict(ShardStream(paths).state_dict())
    assert sorted(ids(load(fresh, batch_size=None, num_workers=3))) == list(range(9))
    wrong = ShardStream(paths)
    wrong.load_state_dict({"epoch": 0, "samples_yielded": [1, 1], "world_size": 1})
    with pytest.raises(ConfigError, match="positions of 2 worker"):
        per_worker(wrong, monkeypatch, 3)


def test_len_needs_known_lengths(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [5, 3, 7, 4])
    stream = ShardStream(paths, rank=1, world_size=2)
    with pytest.raises(TypeError, match="no len"):
        len(stream)
    assert stream.padded_samples is None
    assert stream.count_lengths() == [5, 3, 7, 4] and stream.shard_lengths == [5, 3, 7, 4]
    assert len(stream) == 7 and stream.dropped_samples == 0
    given = ShardStream(paths, rank=0, world_size=2, lengths=[5, 3, 7, 4], uneven="pad")
    assert len(given) == 12
    wrong = ShardStream(paths, rank=1, world_size=2, lengths=[5, 4, 7, 4])
    with pytest.raises(DataError, match="yielded 3 samples, but its length"):
        list(wrong)


def test_built_in_and_custom_readers(tmp_path: Path) -> None:
    np.save(tmp_path / "a.npy", np.arange(6, dtype=np.float32).reshape(3, 2))
    torch.save([torch.tensor([9]), torch.tensor([8, 7])], tmp_path / "b.pt")
    torch.save(torch.arange(4).reshape(2, 2), tmp_path / "c.pt")
    samples = list(ShardStream([tmp_path / "a.npy", tmp_path / "b.pt", tmp_path / "c.pt"]))
    assert [s.tolist() for s in samples] == [
        [0.0, 1.0],
        [2.0, 3.0],
        [4.0, 5.0],
        [9],
        [8, 7],
        [0, 1],
        [2, 3],
    ]
    (tmp_path / "d.txt").write_text("x\ny\n")
    with pytest.raises(DataError, match=r"no built-in reader for shard type\(s\) .txt"):
        ShardStream([tmp_path / "d.txt"])
    stream = ShardStream([tmp_path / "d.txt"], read_shard=lambda p: p.read_text().split())
    assert list(stream) == ["x", "y"] and stream.count_lengths() == [2]


def test_bad_inputs_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no shard files match"):
        ShardStream(str(tmp_path / "*.jsonl"))
    with pytest.raises(DataError, match="not found"):
        ShardStream([tmp_path / "missing.jsonl"])
    (tmp_path / "bad.jsonl").write_text('{"id": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2"):
        list(ShardStream([tmp_path / "bad.jsonl"]))
    with pytest.raises(ConfigError, match="uneven='trim'"):
        ShardStream([tmp_path / "bad.jsonl"], uneven="trim")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="rank 1 has no samples to repeat"):
        list(ShardStream([tmp_path / "bad.jsonl"], rank=0, world_size=3, uneven="pad", lengths=[1]))
