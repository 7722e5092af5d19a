"""In-memory arrays: gathered by blocks, served in-process whatever num_workers says."""

from __future__ import annotations

import logging

import pytest
import torch

from stoker import ArrayDataset, build_loader
from stoker.data import loader_fast


def arrays(n: int = 203, width: int = 3, fields: int = 2) -> ArrayDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=generator)
    extra = [torch.arange(n) * 10, torch.arange(n).double()][: fields - 1]
    return ArrayDataset(x, *extra)


def reference(loader, epoch: int) -> list[tuple[torch.Tensor, ...]]:
    """The batches PyTorch's own DataLoader yields for ``epoch`` (the same sampler)."""
    loader.set_epoch(epoch)
    return [tuple(batch) for batch in loader.dataloader]


def same(left: list, right: list) -> bool:
    return len(left) == len(right) and all(
        len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
        for a, b in zip(left, right, strict=True)
    )


@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("width", [3, 4096])  # small rows: by blocks; wide rows: batch by batch
@pytest.mark.parametrize(
    "options",
    [
        {"shuffle": True},
        {"shuffle": False},
        {"shuffle": True, "drop_last": True},
        {"weights": torch.linspace(0.1, 1.0, 203), "num_samples": 150},
    ],
)
def test_batches_equal_the_dataloaders(batch_size: int, width: int, options: dict) -> None:
    loader = build_loader(arrays(width=width), batch_size=batch_size, seed=3, **options)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        mine = list(loader)
        assert loader.epoch == epoch + 1
        assert same(mine, reference(loader, epoch))
        assert all(field.is_contiguous() for batch in mine for field in batch)


@pytest.mark.parametrize("fields", [1, 2, 3])
def test_any_number_of_fields(fields: int) -> None:
    loader = build_loader(arrays(fields=fields), batch_size=16, shuffle=True)
    batches = list(loader)
    assert all(isinstance(b, tuple) and len(b) == fields for b in batches)
    assert same(batches, reference(loader, 0))


def test_small_batches_come_by_blocks_large_ones_alone() -> None:
    rows = torch.arange(1000)
    small = loader_fast.ArrayGather((torch.zeros(1000, 2),), batch_size=10, pin=False)
    blocked = list(small.batches(rows))
    assert small.block_rows and len(blocked) == 100
    assert blocked[0][0].untyped_storage().nbytes() > 10 * 2 * 4  # a slice of its block
    wide = loader_fast.ArrayGather(
        (torch.zeros(1000, 100_000, dtype=torch.uint8),), batch_size=10, pin=False
    )
    alone = list(wide.batches(rows))
    assert not wide.block_rows and len(alone) == 100
    assert alone[0][0].untyped_storage().nbytes() == 10 * 100_000
    assert list(small.batches(rows[:0])) == [] and list(wide.batches(rows[:0])) == []


@pytest.mark.parametrize("width", [3, 4096])
def test_resume_mid_epoch_skips_without_reading(width: int) -> None:
    options = {"batch_size": 8, "shuffle": True, "seed": 11}
    loader = build_loader(arrays(width=width), **options)
    full = list(loader)
    loader.set_epoch(0)
    seen = []
    for batch in loader:
        seen.append(batch)
        if len(seen) == 5:
            break
    state = loader.state_dict()
    assert state == {"epoch": 0, "batches_delivered": 5}
    resumed = build_loader(arrays(width=width), **options)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert same(seen + rest, full)
    assert resumed.epoch == 1 and resumed.batches_delivered == 0
    past_the_end = build_loader(arrays(width=width), **options)
    past_the_end.load_state_dict({"epoch": 0, "batches_delivered": 10_000})
    assert list(past_the_end) == [] and past_the_end.epoch == 1


def test_workers_are_ignored_for_in_memory_arrays(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="stoker")
    loader_fast._said.clear()
    plain = build_loader(arrays(), batch_size=16, shuffle=True, seed=2)
    options = {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 4}
    served = build_loader(arrays(), batch_size=16, shuffle=True, seed=2, **options)
    assert plain.note is None
    assert served.note == (
        "loader: in-memory data, serving batches in-process; num_workers=2 ignored "
        "(a batch is one gather away: workers would only pickle and copy it)"
    )
    assert served.dataloader.num_workers == 0
    assert same(list(served), list(plain))
    build_loader(arrays(), batch_size=16, num_workers=3)
    said = [r.message for r in caplog.records if "in-process" in r.message]
    assert said == [served.note]  # said once, however many loaders follow


class Doubled(ArrayDataset):
    """An ArrayDataset with a transform in its fetch: work that workers can share."""

    def __getitems__(self, indices):
        x, y = super().__getitems__(indices)
        return x * 2, y


def test_workers_are_kept_when_fetching_does_work() -> None:
    x, y = torch.randn(40, 3), torch.arange(40)
    transformed = build_loader(Doubled(x, y), batch_size=8, num_workers=2)
    own_collate = build_loader(ArrayDataset(x, y), batch_size=8, num_workers=2, collate_fn=list)
    for loader in (transformed, own_collate):
        assert loader.note is None and loader.dataloader.num_workers == 2
    assert torch.equal(torch.cat([b[0] for b in transformed]), x * 2)


@pytest.mark.cuda
@pytest.mark.parametrize("width", [3, 4096])
def test_pinned_batches_are_pinned_and_equal(width: int) -> None:
    loader = build_loader(arrays(width=width), batch_size=8, shuffle=True, pin_memory=True)
    batches = list(loader)
    assert all(field.is_pinned() for batch in batches for field in batch)
    assert same(batches, reference(loader, 0))


@pytest.mark.cuda
@pytest.mark.parametrize("width", [3, 4096])
def test_device_resident_arrays_are_gathered_on_the_device(width: int) -> None:
    data = arrays(width=width)
    on_gpu = ArrayDataset(*[t.cuda() for t in data.arrays])
    loader = build_loader(on_gpu, batch_size=8, shuffle=True, pin_memory=True, seed=4)
    batches = list(loader)
    assert all(field.is_cuda for batch in batches for field in batch)
    cpu = build_loader(data, batch_size=8, shuffle=True, seed=4)
    assert same([tuple(f.cpu() for f in b) for b in batches], list(cpu))


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("total", "batch_size"), [(23, 5), (20, 5), (3, 5), (0, 4)])
def test_in_order_batches_are_made_one_at_a_time(total: int, batch_size: int, drop_last) -> None:
    """In order, the epoch's batches equal BatchSampler's, without the epoch's index."""
    batch_sampler = torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(range(total)), batch_size, drop_last
    )
    batches = loader_fast.epoch_batches(batch_sampler)
    assert not isinstance(batches, list)  # a generator: nothing made ahead
    assert [b.tolist() for b in batches] == list(batch_sampler)


def test_shuffled_batches_equal_the_batch_samplers() -> None:
    from stoker.data import EpochRandomSampler

    batch_sampler = torch.utils.data.BatchSampler(EpochRandomSampler(23, seed=1), 5, False)
    batches = [b.tolist() for b in loader_fast.epoch_batches(batch_sampler)]
    assert batches == list(batch_sampler)
    assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
