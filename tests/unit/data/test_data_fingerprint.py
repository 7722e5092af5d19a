"""Tests for stoker.data.fingerprint: file, array and sample fingerprints, and the resume check."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import ConcatDataset, Dataset, IterableDataset, Subset, TensorDataset

from stoker.data.cache import CachedDataset
from stoker.data.fingerprint import (
    FINGERPRINT_FILE,
    Fingerprint,
    check_fingerprint,
    fingerprint_dataset,
    fingerprint_files,
    read_fingerprint,
    verify_dataset,
    write_fingerprint,
)
from stoker.data.sources import ArrayDataset
from stoker.errors import DataError

BLOCK = 64 * 1024
SIZE = 4 * 1024 * 1024  # 4 MiB: larger than the 16 sampled blocks, so fast mode samples


def random_file(path: Path, size: int = SIZE, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def block_offsets(size: int) -> list[int]:
    """Where fast mode reads, as documented: 16 evenly spaced 64 KiB blocks."""
    return [i * (size - BLOCK) // 15 for i in range(16)]


class Items(Dataset):
    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


class Augmented(Dataset):
    """Random noise on every read, from the global RNGs, as transforms do."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int):
        return torch.full((3,), float(i)) + torch.rand(3), random.random(), np.random.rand()


class FileBacked(Dataset):
    def __init__(self, files: list[Path]) -> None:
        self.files = files

    def fingerprint_paths(self) -> list[Path]:
        return self.files

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int):
        raise AssertionError("fingerprinting a file-backed dataset must not read samples")


class Stream(IterableDataset):
    def __init__(self, shards: list[Path] | None = None) -> None:
        self.shards = shards

    def __iter__(self):
        return iter(range(3))


# ------------------------------------------------------------------ files


def test_same_content_in_another_folder_has_the_same_fingerprint(tmp_path: Path) -> None:
    a = random_file(tmp_path / "a" / "data.bin")
    b = random_file(tmp_path / "b" / "data.bin")
    for full in (False, True):
        fa, fb = fingerprint_files(a, full=full), fingerprint_files(b, full=full)
        assert fa == fb
        assert fa.kind == "files" and fa.files == 1 and fa.size_bytes == SIZE
        assert fa.mode == ("full" if full else "fast")
        assert len(fa.digest) == 64 and fa.short == fa.digest[:16]
    # Fast and full digests differ, so they are never compared with each other.
    assert fingerprint_files(a).digest != fingerprint_files(a, full=True).digest


def test_fast_mode_catches_a_change_inside_a_sampled_block(tmp_path: Path) -> None:
    file = random_file(tmp_path / "data.bin")
    before = fingerprint_files(file)
    middle_block = block_offsets(SIZE)[7]
    flip_byte(file, middle_block + BLOCK // 2)
    assert fingerprint_files(file) != before


def test_fast_mode_catches_a_size_change(tmp_path: Path) -> None:
    file = random_file(tmp_path / "data.bin")
    before = fingerprint_files(file)
    with open(file, "ab") as handle:
        handle.write(b"\0")
    after = fingerprint_files(file)
    assert after != before and after.size_bytes == SIZE + 1


def test_fast_mode_can_miss_a_change_between_blocks_and_full_mode_catches_it(
    tmp_path: Path,
) -> None:
    file = random_file(tmp_path / "data.bin")
    fast, full = fingerprint_files(file), fingerprint_files(file, full=True)
    offsets = block_offsets(SIZE)
    gap = (offsets[0] + BLOCK + offsets[1]) // 2  # between the first and second block
    assert all(not o <= gap < o + BLOCK for o in offsets)
    flip_byte(file, gap)
    # The documented limit of fast mode, and the reason full mode exists.
    assert fingerprint_files(file) == fast
    assert fingerprint_files(file, full=True) != full


def test_small_files_are_hashed_whole_even_in_fast_mode(tmp_path: Path) -> None:
    file = random_file(tmp_path / "small.bin", size=300_000)
    before = fingerprint_files(file)
    flip_byte(file, 150_000)
    assert fingerprint_files(file) != before


def test_folders_are_walked_in_order_and_names_count(tmp_path: Path) -> None:
    root = tmp_path / "data"
    random_file(root / "b.bin", size=1000, seed=1)
    random_file(root / "sub" / "a.bin", size=1000, seed=2)
    (root / ".DS_Store").write_bytes(b"ignored")
    base = fingerprint_files(root)
    assert base.files == 2 and base.size_bytes == 2000

    (root / ".DS_Store").write_bytes(b"still ignored: hidden")
    assert fingerprint_files(root) == base
    moved = root.rename(tmp_path / "elsewhere")
    assert fingerprint_files(moved) == base, "moving the folder keeps the fingerprint"
    (moved / "b.bin").rename(moved / "c.bin")
    assert fingerprint_files(moved) != base, "renaming a file changes it"
    (moved / "c.bin").rename(moved / "b.bin")
    random_file(moved / "new.bin", size=10)
    assert fingerprint_files(moved).files == 3


def test_missing_paths_and_empty_folders_are_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no such file"):
        fingerprint_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="hold no files"):
        fingerprint_files(tmp_path / "empty")


def test_fast_mode_on_a_large_sparse_file_is_fast(tmp_path: Path) -> None:
    file = tmp_path / "big.bin"
    with open(file, "wb") as handle:
        handle.truncate(200 * 1024 * 1024)
    start = time.process_time()
    fingerprint = fingerprint_files(file)
    cpu_s = time.process_time() - start
    assert fingerprint.size_bytes == 200 * 1024 * 1024
    # CPU time, not wall time: other work on the machine cannot stretch it. Hashing the
    # whole 200 MB would take ~0.3 s of CPU at the very least (SHA-256 at under 1 GB/s).
    assert cpu_s < 0.15, f"fast mode took {cpu_s:.3f} s of CPU on a 200 MB file"


# ------------------------------------------------------------------ datasets


def test_file_backed_datasets_use_their_files(tmp_path: Path) -> None:
    files = [random_file(tmp_path / f"{i}.bin", size=5000, seed=i) for i in range(2)]
    fingerprint = fingerprint_dataset(FileBacked(files))
    assert fingerprint.kind == "files" and fingerprint.files == 2
    assert fingerprint.num_samples == 7
    assert fingerprint.digest == fingerprint_files(files, num_samples=7).digest

    class WithRoot(Items):
        root = str(tmp_path)

    assert fingerprint_dataset(WithRoot([1, 2])).kind == "files"

    class WithMissingPath(Items):
        path = str(tmp_path / "missing")

    assert fingerprint_dataset(WithMissingPath([1, 2])).kind == "samples"


def test_arrays_match_across_containers_and_differ_by_content() -> None:
    x = torch.randn(200, 4, generator=torch.Generator().manual_seed(0))
    y = torch.arange(200)
    base = fingerprint_dataset(ArrayDataset(x, y))
    assert base.kind == "arrays" and base.num_samples == 200
    assert base.size_bytes == x.nbytes + y.nbytes
    assert fingerprint_dataset(TensorDataset(x, y)) == base
    assert fingerprint_dataset(ArrayDataset(x.numpy(), y.numpy())) == base
    assert fingerprint_dataset(ArrayDataset(x.clone(), y.clone())) == base

    changed = x.clone()
    changed[0, 0] += 1
    assert fingerprint_dataset(ArrayDataset(changed, y)) != base
    assert fingerprint_dataset(ArrayDataset(x.double(), y)) != base
    assert fingerprint_dataset(ArrayDataset(x.reshape(200, 2, 2), y)) != base
    assert fingerprint_dataset(x).kind == "arrays"
    assert fingerprint_dataset(x.to(torch.bfloat16), full=True).kind == "arrays"


def test_fast_mode_samples_array_rows_and_full_mode_reads_all() -> None:
    x = np.zeros((100_000, 16), dtype=np.float32)  # 64 B rows: about 16k rows sampled
    fast, full = fingerprint_dataset(x), fingerprint_dataset(x, full=True)
    x[1, 0] = 1.0  # row 1 lies between the first two sampled rows
    assert fingerprint_dataset(x) == fast
    assert fingerprint_dataset(x, full=True) != full
    x[0, 0] = 1.0  # the first row is always sampled
    assert fingerprint_dataset(x) != fast


def test_generic_datasets_are_fingerprinted_by_length_and_samples() -> None:
    items = [{"x": torch.tensor([i, i + 1]), "label": i % 3, "name": f"s{i}"} for i in range(100)]
    base = fingerprint_dataset(Items(items))
    assert base.kind == "samples" and base.num_samples == 100 and base.size_bytes is None
    assert fingerprint_dataset(Items([dict(item) for item in items])) == base

    first_changed = list(items)
    first_changed[0] = {**items[0], "name": "other"}
    assert fingerprint_dataset(Items(first_changed)) != base
    assert fingerprint_dataset(Items(items[:-1])) != base

    # Item 1 is not among the 32 sampled items; only full mode reads it.
    middle_changed = list(items)
    middle_changed[1] = {**items[1], "label": 99}
    assert fingerprint_dataset(Items(middle_changed)) == base
    assert fingerprint_dataset(Items(middle_changed), full=True) != fingerprint_dataset(
        Items(items), full=True
    )


def test_random_augmentation_does_not_change_the_fingerprint_or_the_rngs() -> None:
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    expected = (torch.rand(1), random.random(), np.random.rand())
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    first = fingerprint_dataset(Augmented())
    assert fingerprint_dataset(Augmented()) == first
    assert (torch.rand(1), random.random(), np.random.rand()) == expected


def test_subset_indices_matter() -> None:
    base = ArrayDataset(torch.arange(20.0).reshape(10, 2))
    a = fingerprint_dataset(Subset(base, [0, 1, 2]))
    assert a == fingerprint_dataset(Subset(base, [0, 1, 2]))
    assert a != fingerprint_dataset(Subset(base, [0, 1, 3]))
    assert a != fingerprint_dataset(Subset(base, [2, 1, 0]))
    assert a.num_samples == 3 and a.kind == "arrays"
    assert fingerprint_dataset(Subset(Items(list(range(10))), [4, 5])).kind == "samples"


def test_concat_and_cached_datasets_are_fingerprinted_by_their_parts() -> None:
    a, b = Items([1, 2, 3]), Items([4, 5])
    both = fingerprint_dataset(ConcatDataset([a, b]))
    assert both.num_samples == 5
    assert both != fingerprint_dataset(ConcatDataset([b, a]))
    assert fingerprint_dataset(CachedDataset(a)) == fingerprint_dataset(a)


def test_streams_use_their_shards_or_are_unknown(tmp_path: Path) -> None:
    shard = random_file(tmp_path / "shard-0.bin", size=100)
    assert fingerprint_dataset(Stream([shard])) == fingerprint_files([shard])
    unknown = fingerprint_dataset(Stream())
    assert unknown.kind == "unknown" and unknown.num_samples is None
    assert "could not be fingerprinted" in unknown.describe()


# ------------------------------------------------------------------ checking and storing


def test_check_passes_for_equal_data_and_raises_with_the_fix_otherwise() -> None:
    x = torch.arange(40.0).reshape(20, 2)
    saved = fingerprint_dataset(ArrayDataset(x))
    assert check_fingerprint(saved, fingerprint_dataset(ArrayDataset(x.clone()))) is None
    assert check_fingerprint(saved.to_dict(), fingerprint_dataset(ArrayDataset(x))) is None

    current = fingerprint_dataset(ArrayDataset(x[:15]))
    with pytest.raises(DataError) as caught:
        check_fingerprint(saved, current)
    text = str(caught.value)
    assert "differs from the run being resumed" in text
    assert saved.short in text and current.short in text
    assert "20 samples" in text and "15 samples" in text and "160 B" in text
    assert "--allow-data-change" in caught.value.hint

    warning = check_fingerprint(saved, current, allow_change=True)
    assert isinstance(warning, str)
    assert saved.short in warning and current.short in warning


def test_check_refuses_to_compare_different_modes() -> None:
    x = ArrayDataset(torch.arange(10.0))
    with pytest.raises(DataError, match="cannot compare a full data fingerprint") as caught:
        check_fingerprint(fingerprint_dataset(x), fingerprint_dataset(x, full=True))
    assert "full=False" in caught.value.hint


def test_unknown_data_is_never_called_equal_but_does_not_block_resume() -> None:
    unknown = fingerprint_dataset(Stream())
    warning = check_fingerprint(unknown, fingerprint_dataset(Stream()))
    assert warning is not None and "not checked" in warning


def test_verify_dataset_recomputes_in_the_saved_mode() -> None:
    items = Items(list(range(100)))
    saved = fingerprint_dataset(items, full=True)
    assert verify_dataset(items, saved.to_dict()) is None
    changed = Items([*range(99), -1])
    with pytest.raises(DataError, match="differs"):
        verify_dataset(changed, saved)
    assert "differs" in verify_dataset(changed, saved, allow_change=True)


def test_dict_round_trip_survives_a_weights_only_checkpoint(tmp_path: Path) -> None:
    fingerprint = fingerprint_dataset(ArrayDataset(torch.ones(5, 2)))
    data = fingerprint.to_dict()
    assert Fingerprint.from_dict(data) == fingerprint
    assert json.loads(json.dumps(data)) == data
    torch.save({"data_fingerprint": data}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert Fingerprint.from_dict(loaded["data_fingerprint"]) == fingerprint


@pytest.mark.parametrize(
    "data",
    [{"kind": "files", "mode": "fast"}, {"digest": "ab", "kind": "bogus", "mode": "fast"}],
)
def test_malformed_dicts_are_errors(data: dict) -> None:
    with pytest.raises(DataError, match="malformed"):
        Fingerprint.from_dict(data)


def test_write_and_read_in_the_run_dir(tmp_path: Path) -> None:
    assert read_fingerprint(tmp_path) is None
    fingerprint = fingerprint_dataset(Items([1, 2, 3]))
    path = write_fingerprint(fingerprint, tmp_path / "run")
    assert path == tmp_path / "run" / FINGERPRINT_FILE
    assert json.loads(path.read_text())["digest"] == fingerprint.digest
    assert read_fingerprint(tmp_path / "run") == fingerprint
    for text in ("{not json", "[1, 2]"):
        path.write_text(text)
        with pytest.raises(DataError, match="is not a data fingerprint") as caught:
            read_fingerprint(tmp_path / "run")
        assert "--allow-data-change" in caught.value.hint
