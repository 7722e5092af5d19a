"""Tests for stoker.data.memmap: NpyDataset over memory-mapped .npy files."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from stoker.data import build_loader, memmap
from stoker.data.memmap import NpyDataset, normalize_indices
from stoker.errors import ConfigError, DataError


def write_fields(folder: Path, n: int = 50) -> tuple[np.ndarray, np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = (np.arange(n) * 7 % 5).astype(np.int64)
    np.save(folder / "features.npy", x)
    np.save(folder / "target.npy", y)
    return x, y


@pytest.fixture(params=[True, False], ids=["mapped", "by-position"])
def mmap_mode(request: pytest.FixtureRequest) -> bool:
    return request.param


def test_folder_fields_give_values_for_indices(tmp_path: Path, mmap_mode: bool) -> None:
    x, y = write_fields(tmp_path)
    ds = NpyDataset(tmp_path, mmap=mmap_mode)
    assert len(ds) == 50 and ds.names == ("features", "target")
    bx, by = ds.__getitems__([7, 0, 49, 7, -1])
    assert bx.dtype == torch.float32 and by.dtype == torch.int64
    assert bx.shape == (5, 3) and by.shape == (5,)
    np.testing.assert_array_equal(bx.numpy(), x[[7, 0, 49, 7, 49]])
    np.testing.assert_array_equal(by.numpy(), y[[7, 0, 49, 7, 49]])
    sx, sy = ds[12]
    np.testing.assert_array_equal(sx.numpy(), x[12])
    assert sy.item() == y[12] and sy.dim() == 0


def test_getitems_equals_stacked_getitem(tmp_path: Path, mmap_mode: bool) -> None:
    write_fields(tmp_path)
    ds = NpyDataset(tmp_path, mmap=mmap_mode)
    indices = [31, 2, 2, 40, 9]
    batch = ds.__getitems__(indices)
    for field, column in enumerate(batch):
        assert torch.equal(column, torch.stack([ds[i][field] for i in indices]))
    tensor_batch = ds.__getitems__(torch.tensor(indices))
    assert all(torch.equal(a, b) for a, b in zip(batch, tensor_batch, strict=True))


def test_fetched_tensors_own_their_memory(tmp_path: Path, mmap_mode: bool) -> None:
    x, _ = write_fields(tmp_path)
    ds = NpyDataset(tmp_path, mmap=mmap_mode)
    bx, _ = ds.__getitems__([1, 2])
    single, _ = ds[1]
    bx += 1000
    single += 1000
    np.testing.assert_array_equal(ds.__getitems__([1, 2])[0].numpy(), x[[1, 2]])
    np.testing.assert_array_equal(ds[1][0].numpy(), x[1])


def test_target_field_comes_second_and_targets_reads_it(tmp_path: Path) -> None:
    a = np.arange(10, dtype=np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", a * 2)
    np.save(tmp_path / "label.npy", np.arange(10) % 2)
    ds = NpyDataset(tmp_path)
    assert ds.names == ("a", "label", "b")
    assert ds.target_name == "label"
    assert ds.targets.tolist() == [0, 1] * 5
    first, label, second = ds[3]
    assert (first.item(), label.item(), second.item()) == (3.0, 1, 6.0)


def test_mapping_and_sequence_fields_keep_their_order(tmp_path: Path) -> None:
    x, y = write_fields(tmp_path)
    ds = NpyDataset({"y": tmp_path / "target.npy", "x": tmp_path / "features.npy"})
    assert ds.names == ("y", "x")
    assert ds.targets is not None and ds.targets.shape == (50,)  # "y" is a target name
    by, bx = ds.__getitems__([3])
    assert by.item() == y[3] and bx[0].tolist() == x[3].tolist()
    seq = NpyDataset([tmp_path / "features.npy", tmp_path / "target.npy"])
    assert seq.names == ("features", "target")
    assert torch.equal(seq.targets, torch.from_numpy(y))
    single = NpyDataset([tmp_path / "features.npy"])
    assert single.targets is None and len(single[0]) == 1


def test_without_a_target_name_the_second_field_is_the_target(tmp_path: Path) -> None:
    np.save(tmp_path / "inputs.npy", np.zeros((4, 2), dtype=np.float32))
    np.save(tmp_path / "classes.npy", np.array([3, 1, 2, 0]))
    ds = NpyDataset([tmp_path / "inputs.npy", tmp_path / "classes.npy"])
    assert ds.target_name == "classes"
    assert ds.targets.tolist() == [3, 1, 2, 0]


def test_lengths_that_differ_name_each_file(tmp_path: Path) -> None:
    np.save(tmp_path / "features.npy", np.zeros((10, 2), dtype=np.float32))
    np.save(tmp_path / "target.npy", np.zeros(9, dtype=np.int64))
    with pytest.raises(DataError) as info:
        NpyDataset(tmp_path)
    message = str(info.value)
    assert "features.npy has 10" in message and "target.npy has 9" in message


def test_missing_and_malformed_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="nowhere"):
        NpyDataset(tmp_path / "nowhere")
    with pytest.raises(DataError, match="missing.npy"):
        NpyDataset({"x": tmp_path / "missing.npy"})
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(DataError, match=r"text\.npy"):
        NpyDataset([tmp_path / "text.npy"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no \\*.npy files"):
        NpyDataset(empty)
    np.save(tmp_path / "strings.npy", np.array(["a", "b"]))
    with pytest.raises(DataError, match="dtype <U1"):
        NpyDataset([tmp_path / "strings.npy"])


def test_out_of_range_index_raises_index_error(tmp_path: Path) -> None:
    write_fields(tmp_path, n=5)
    ds = NpyDataset(tmp_path)
    with pytest.raises(IndexError, match="5 samples"):
        ds[5]
    with pytest.raises(IndexError, match="index -6"):
        ds.__getitems__([0, -6])


def test_non_native_byte_order_is_converted(tmp_path: Path, mmap_mode: bool) -> None:
    values = np.arange(6, dtype=">f4").reshape(3, 2)
    np.save(tmp_path / "big.npy", values)
    (column,) = NpyDataset([tmp_path / "big.npy"], mmap=mmap_mode).__getitems__([2, 0])
    assert column.dtype == torch.float32
    assert column.tolist() == [[4.0, 5.0], [0.0, 1.0]]


def test_reads_by_position_cover_runs_duplicates_and_both_read_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, y = write_fields(tmp_path, n=100)
    np.save(tmp_path / "extra.npy", np.arange(100 * 6, dtype=np.int16).reshape(100, 2, 3))
    ds = NpyDataset(tmp_path, mmap=False)
    assert ds.names == ("extra", "target", "features")
    wanted = [5, 6, 7, 7, 99, 0, 1, 50, 6]
    for pread in (True, False):
        monkeypatch.setattr(memmap, "_HAS_PREAD", pread and memmap._HAS_PREAD)
        extra, by, bx = ds.__getitems__(wanted)
        np.testing.assert_array_equal(bx.numpy(), x[wanted])
        np.testing.assert_array_equal(by.numpy(), y[wanted])
        assert extra.shape == (9, 2, 3) and extra[4].flatten().tolist() == list(range(594, 600))
        _, _, all_rows = ds.__getitems__(list(range(100)))
        np.testing.assert_array_equal(all_rows.numpy(), x)
    assert [t.shape for t in ds.__getitems__([])] == [(0, 2, 3), (0,), (0, 3)]
    assert torch.equal(ds.targets, torch.from_numpy(y))


def test_reads_by_position_refuse_fortran_order(tmp_path: Path) -> None:
    np.save(tmp_path / "f.npy", np.asfortranarray(np.zeros((4, 3), dtype=np.float32)))
    with pytest.raises(DataError, match="Fortran order"):
        NpyDataset([tmp_path / "f.npy"], mmap=False)
    assert NpyDataset([tmp_path / "f.npy"]).__getitems__([1])[0].shape == (1, 3)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    write_fields(tmp_path, n=10)
    ds = NpyDataset(tmp_path, mmap=False)
    path = tmp_path / "features.npy"
    path.write_bytes(path.read_bytes()[:-12])  # the last row lost
    with pytest.raises(DataError, match="features.npy is shorter"):
        ds.__getitems__([9])


needs_madvise = pytest.mark.skipif(
    not memmap._CAN_RELEASE, reason="mmap.madvise is not available here"
)


def spy(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[int]:
    """Count the calls of ``owner.name`` (which still runs)."""
    calls: list[int] = []
    original = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *args: (calls.append(1), original(*args))[1])
    return calls


def assert_same_bytes(tensor: torch.Tensor, expected: np.ndarray) -> None:
    assert tensor.numpy().tobytes() == np.ascontiguousarray(expected).tobytes()


@needs_madvise
def test_mapped_reads_release_before_overrunning_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, _ = write_fields(tmp_path / "fields", n=2000)
    releases = spy(monkeypatch, NpyDataset, "_release_pages")
    by_position = spy(monkeypatch, memmap, "_read_rows")
    ds = NpyDataset(tmp_path / "fields", max_mapped_mib=0)
    for start in range(0, 2000, 100):
        chunk = np.arange(start, start + 100)[::-1]  # contiguous, in any order
        assert_same_bytes(ds.__getitems__(chunk.tolist())[0], x[chunk])
    # A budget of 0 fits no read: each field's read is preceded by a release.
    assert len(releases) == 40 and not by_position
    wide = np.arange(4000 * 1024, dtype=np.float32).reshape(4000, 1024)  # 4 KiB rows
    np.save(tmp_path / "wide.npy", wide)
    sparse = NpyDataset([tmp_path / "wide.npy"], max_mapped_mib=0)
    scattered = np.random.default_rng(0).permutation(4000)[:10]
    assert_same_bytes(sparse.__getitems__(scattered)[0], wide[scattered])
    assert len(releases) == 40 and len(by_position) == 1  # 10 rows spread over 16 MB
    sparse.__getitems__(np.arange(10))  # 10 rows in one folio: mapped
    assert len(releases) == 41 and len(by_position) == 1
    never = NpyDataset(tmp_path / "fields", max_mapped_mib=None)
    never.__getitems__(np.random.default_rng(1).permutation(2000))
    assert len(releases) == 41 and len(by_position) == 1
    with pytest.raises(ConfigError, match="max_mapped_mib"):
        NpyDataset(tmp_path / "fields", max_mapped_mib=-1)


@needs_madvise
def test_files_within_the_budget_stay_mapped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, y = write_fields(tmp_path, n=5000)
    releases = spy(monkeypatch, NpyDataset, "_release_pages")
    by_position = spy(monkeypatch, memmap, "_read_rows")
    ds = NpyDataset(tmp_path, max_mapped_mib=1)
    batches = list(build_loader(ds, batch_size=64, shuffle=True, seed=0))
    assert not releases and not by_position
    assert ds._mapped_total == sum(ds._sizes)  # each file counted once, however often read
    rows = torch.cat([b[0] for b in batches]).numpy()
    np.testing.assert_array_equal(
        y[(rows[:, 0] // 3).astype(int)], torch.cat([b[1] for b in batches])
    )


@needs_madvise
def test_sparse_batches_over_the_budget_are_read_by_position(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 4 KiB rows over 16 MiB, a budget of 1 MiB: 32 rows span about 8 folios.
    wide = np.random.default_rng(0).standard_normal((4096, 1024), dtype=np.float32)
    np.save(tmp_path / "wide.npy", wide)
    np.save(tmp_path / "label.npy", np.arange(4096))
    releases = spy(monkeypatch, NpyDataset, "_release_pages")
    by_position = spy(monkeypatch, memmap, "_read_rows")
    ds = NpyDataset(tmp_path, max_mapped_mib=1)
    order = np.random.default_rng(1).permutation(4096)
    for start in range(0, 4096, 32):
        wanted = order[start : start + 32]
        rows, labels = ds.__getitems__(wanted)
        assert_same_bytes(rows, wide[wanted])
        assert labels.tolist() == wanted.tolist()
    assert len(by_position) == 4096 // 32  # the wide field; the labels (32 KiB) stay mapped
    assert not releases and ds._mapped_total == ds._sizes[1]
    # A Fortran-order field cannot be read by position: it is mapped, released as needed.
    np.save(tmp_path / "fortran.npy", np.asfortranarray(wide))
    fortran = NpyDataset([tmp_path / "fortran.npy"], max_mapped_mib=1)
    assert_same_bytes(fortran.__getitems__(order[:32])[0], wide[order[:32]])
    assert len(by_position) == 4096 // 32 and len(releases) == 1


@needs_madvise
def test_dense_batches_over_the_budget_are_mapped_a_piece_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 256-byte rows over 32 MiB, a budget of 4 MiB: a batch of 16384 rows is dense.
    x = np.random.default_rng(0).standard_normal((2**17, 64), dtype=np.float32)
    np.save(tmp_path / "x.npy", x)
    releases = spy(monkeypatch, NpyDataset, "_release_pages")
    by_position = spy(monkeypatch, memmap, "_read_rows")
    counted = []
    original = NpyDataset._count
    monkeypatch.setattr(
        NpyDataset,
        "_count",
        lambda self, *args: (original(self, *args), counted.append(self._mapped_total)),
    )
    ds = NpyDataset([tmp_path / "x.npy"], max_mapped_mib=4)
    for wanted in np.array_split(np.random.default_rng(1).permutation(2**17), 8):
        assert_same_bytes(ds.__getitems__(wanted)[0], x[wanted])
    assert not by_position
    assert len(releases) >= 8 * 7  # 8 pieces of 4 MiB a batch, a release before each but one
    assert max(counted) <= (4 << 20) + memmap._FOLIO  # a piece's last row may end a folio on


def proc_status_mib(key: str) -> float:
    """A memory figure of this process from /proc/self/status (Linux), in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {key} in /proc/self/status")


@pytest.mark.skipif(
    not memmap._CAN_RELEASE or not Path("/proc/self/status").exists(),
    reason="needs madvise and /proc (Linux)",
)
def test_rss_stays_bounded_when_released_or_read_by_position(tmp_path: Path) -> None:
    rows = 32 * 2**20 // 256  # 32 MiB files: of 256-byte rows, and of 4 KiB rows
    np.save(tmp_path / "x.npy", np.ones((rows, 64), dtype=np.float32))
    np.save(tmp_path / "wide.npy", np.ones((rows // 16, 1024), dtype=np.float32))
    shuffled = np.random.default_rng(0).permutation(rows)
    wide_order = np.random.default_rng(1).permutation(rows // 16)
    growth = {}
    runs = [
        ("mapped, kept", "x.npy", {"max_mapped_mib": None}, np.arange(rows), 1024),
        ("mapped, released", "x.npy", {"max_mapped_mib": 4}, np.arange(rows), 1024),
        # 64 rows over 16 folios: mapped, each batch would map nearly the whole file.
        ("mapped, shuffled, sparse", "wide.npy", {"max_mapped_mib": 4}, wide_order, 64),
        ("by position, shuffled", "x.npy", {"mmap": False}, shuffled, 1024),
    ]
    for name, file, options, order, batch_size in runs:
        ds = NpyDataset([tmp_path / file], **options)
        before = peak = proc_status_mib("RssFile")
        for start in range(0, len(order), batch_size):
            ds.__getitems__(order[start : start + batch_size])
            peak = max(peak, proc_status_mib("RssFile"))
        growth[name] = peak - before
        del ds
    assert growth["mapped, kept"] > 20  # without a limit the whole file ends up mapped
    assert growth["mapped, released"] < 8  # the limit and one batch
    assert growth["mapped, shuffled, sparse"] < 4  # read by position: nothing mapped
    assert growth["by position, shuffled"] < 1  # nothing is mapped at all


def reset_peak_rss() -> None:
    """Set this process's peak RSS (VmHWM) to its current RSS, or skip where Linux does not."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError as error:
        pytest.skip(f"cannot reset the peak RSS: {error}")


@pytest.mark.skipif(
    not memmap._CAN_RELEASE or not Path("/proc/self/clear_refs").exists(),
    reason="needs madvise and /proc/self/clear_refs (Linux)",
)
def test_a_shuffled_pass_over_a_file_larger_than_the_budget_peaks_near_the_budget(
    tmp_path: Path,
) -> None:
    # 256-byte rows over 64 MiB, batches of 4096: dense enough to be mapped, a piece at a
    # time within the 8 MiB budget; mapped whole, each batch would map the whole file.
    np.save(tmp_path / "x.npy", np.ones((2**18, 64), dtype=np.float32))
    ds = NpyDataset([tmp_path / "x.npy"], max_mapped_mib=8)
    ds.__getitems__(np.arange(4096))  # the code a mapped read runs, before the baseline
    ds._release_pages()
    order = np.random.default_rng(0).permutation(len(ds))
    reset_peak_rss()
    before = proc_status_mib("VmRSS")
    for start in range(0, len(ds), 4096):
        ds.__getitems__(order[start : start + 4096])
    # The kernel updates the peak before it unmaps pages, so it sees each release's peak.
    growth = proc_status_mib("VmHWM") - before
    assert growth < 8 + 2 + 8  # the budget, a folio, and the batch and its copies


def test_pickling_does_not_carry_the_mapped_arrays(tmp_path: Path) -> None:
    x, _ = write_fields(tmp_path, n=5000)
    ds = NpyDataset(tmp_path)
    ds.__getitems__([0])
    payload = pickle.dumps(ds)
    assert len(payload) < 2000  # the arrays hold 5000 * 3 * 4 + 5000 * 8 bytes
    clone = pickle.loads(payload)
    assert clone._arrays is None and clone._mapped_total == 0  # nothing mapped here yet
    np.testing.assert_array_equal(clone.__getitems__([4999, 3])[0].numpy(), x[[4999, 3]])


def test_build_loader_fetches_whole_batches(tmp_path: Path, mmap_mode: bool) -> None:
    x, y = write_fields(tmp_path, n=50)
    ds = NpyDataset(tmp_path, mmap=mmap_mode)
    batches = list(build_loader(ds, batch_size=16))
    assert [len(b[0]) for b in batches] == [16, 16, 16, 2]
    np.testing.assert_array_equal(torch.cat([b[0] for b in batches]).numpy(), x)
    shuffled = list(build_loader(ds, batch_size=16, shuffle=True, seed=3))
    seen = torch.cat([b[1] for b in shuffled]).numpy()
    assert sorted(seen.tolist()) == sorted(y.tolist())
    rows = torch.cat([b[0] for b in shuffled]).numpy()
    np.testing.assert_array_equal(y[(rows[:, 0] // 3).astype(int)], seen)


def test_workers_read_after_pickling(tmp_path: Path, mmap_mode: bool) -> None:
    x, y = write_fields(tmp_path, n=40)
    loader = build_loader(NpyDataset(tmp_path, mmap=mmap_mode), batch_size=8, num_workers=2)
    batches = list(loader)
    assert len(batches) == 5
    np.testing.assert_array_equal(torch.cat([b[0] for b in batches]).numpy(), x)
    np.testing.assert_array_equal(torch.cat([b[1] for b in batches]).numpy(), y)


def test_normalize_indices() -> None:
    assert normalize_indices([1, -1, 0], 4).tolist() == [1, 3, 0]
    assert normalize_indices(torch.tensor([2, 3]), 4).dtype == np.int64
    assert normalize_indices([], 4).size == 0
    with pytest.raises(IndexError, match="index 4"):
        normalize_indices([4], 4)
