"""The side-stream device prefetcher: a pass-through on CPU; ordered and safe on CUDA."""

from __future__ import annotations

import pytest
import torch

from stoker.data.prefetch import DevicePrefetcher


def test_cpu_prefetcher_passes_batches_through_untouched() -> None:
    batches = [(torch.arange(4), torch.ones(4))]
    prefetcher = DevicePrefetcher(torch.device("cpu"))
    assert not prefetcher.enabled
    assert prefetcher.wrap(batches) is batches


def test_enabling_it_without_cuda_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device"):
        DevicePrefetcher(torch.device("cpu"), enabled=True)


@pytest.mark.cuda
def test_cuda_prefetcher_delivers_every_batch_on_the_device_in_order() -> None:
    device = torch.device("cuda")
    host = [
        {"x": torch.full((256, 1024), float(i)).pin_memory(), "y": torch.tensor([i]).pin_memory()}
        for i in range(6)
    ]
    prefetcher = DevicePrefetcher(device)
    seen = []
    for batch in prefetcher.wrap(host):
        assert batch["x"].is_cuda and batch["y"].is_cuda
        # Read on the compute stream: ordering must make the copy visible here.
        seen.append((batch["x"].mean().item(), batch["y"].item()))
    assert seen == [(float(i), i) for i in range(6)]


@pytest.mark.cuda
def test_cuda_prefetched_memory_is_not_reused_while_compute_reads_it() -> None:
    """Lifetime: without record_stream the allocator could recycle a prefetched batch's
    memory for the next copy while a long kernel on the compute stream still reads it."""
    device = torch.device("cuda")
    host = [torch.full((2048, 2048), float(i)).pin_memory() for i in range(4)]
    weight = torch.randn(2048, 2048, device=device)
    results = []
    for batch in DevicePrefetcher(device).wrap(host):
        value = batch
        for _ in range(20):  # a long queue of kernels reading `batch`
            value = value @ weight * 0 + batch
        results.append(value.mean().item())
        del batch, value
    assert results == pytest.approx([0.0, 1.0, 2.0, 3.0])


@pytest.mark.cuda
def test_training_on_cuda_uses_the_prefetcher(tmp_path) -> None:
    import stoker

    x = torch.randn(512, 8)
    y = (x[:, 0] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    result = stoker.fit(
        model, (x, y), epochs=2, run_dir=tmp_path, progress="quiet", tensorboard=False
    )
    assert next(result.model.parameters()).is_cuda
    assert result.metrics["time/transfer_s"] >= 0
