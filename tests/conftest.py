"""Shared fixtures: small data and models, and quiet defaults for runs."""

from __future__ import annotations

import pytest
import torch

from stoker_cli import process_state_kept


@pytest.fixture(autouse=True)
def isolated_process_state():
    """Give every test the process-wide state the one before it found, whatever it did.

    ``stoker.fit`` seeds the global RNGs (as a user's run should), tests seed them or set
    the intra-op thread count, and a test may change the environment or the working
    directory: restored after each test, no result can depend on which tests ran before
    it, or in which order (the suite also runs split over pytest-xdist workers).
    """
    with process_state_kept():
        yield


@pytest.fixture
def toy_classification() -> tuple[torch.Tensor, torch.Tensor]:
    """256 samples, 8 features, 3 classes, learnable (label from a linear rule)."""
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(256, 8, generator=generator)
    labels = (features[:, 0] > 0).long() + (features[:, 1] > 0.5).long()
    return features, labels


def small_mlp(in_features: int = 8, out_features: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(in_features, 16), torch.nn.ReLU(), torch.nn.Linear(16, out_features)
    )


@pytest.fixture
def mlp_factory():
    return small_mlp


def pytest_collection_modifyitems(config, items) -> None:
    """Skip `cuda`-marked tests on machines without an NVIDIA GPU (CI, laptops)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
