"""train.threads: the intra-op thread count a run sets, records and puts back."""

from __future__ import annotations

import json

import pytest
import torch

import stoker
from stoker.train import threads as threads_module
from stoker.train.threads import choose_threads, loader_workers


@pytest.fixture
def no_omp_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_auto_takes_away_loader_workers_and_busy_cores_and_keeps_one(no_omp_env) -> None:
    assert choose_threads("auto", num_workers=0, cores=8, busy_elsewhere=0.2)[0] == 8
    assert choose_threads("auto", num_workers=3, cores=8, busy_elsewhere=0.0)[0] == 5
    count, why = choose_threads("auto", num_workers=0, cores=2, busy_elsewhere=1.8)
    assert count == 1 and "2 busy" in why  # a busy shared machine: one thread, not two
    assert choose_threads("auto", num_workers=6, cores=4, busy_elsewhere=0.0)[0] == 1


def test_an_integer_is_used_as_given_and_omp_num_threads_is_kept(monkeypatch) -> None:
    assert choose_threads(3, num_workers=8, cores=2, busy_elsewhere=2.0) == (3, "train.threads=3")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    count, why = choose_threads("auto", num_workers=0, cores=8, busy_elsewhere=0.0)
    assert count == torch.get_num_threads() and "OMP_NUM_THREADS" in why


def test_loader_workers_reads_a_stoker_loader_or_a_dataloader() -> None:
    data = torch.utils.data.TensorDataset(torch.zeros(4, 1))
    assert loader_workers(torch.utils.data.DataLoader(data, num_workers=2)) == 2
    assert loader_workers(stoker.build_loader(data, batch_size=2)) == 0


def test_fit_sets_records_and_restores_the_thread_count(tmp_path, monkeypatch) -> None:
    seen: list[int] = []
    real = threads_module.use_threads

    def spy(setting, *, num_workers):
        chosen = real(setting, num_workers=num_workers)
        seen.append(torch.get_num_threads())
        return chosen

    monkeypatch.setattr("stoker.train.session.use_threads", spy)
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
    result = stoker.fit(
        torch.nn.Linear(4, 2),
        (x, y),
        epochs=1,
        batch_size=16,
        threads=wanted,
        progress="quiet",
        tensorboard=False,
        run_dir=tmp_path / "run",
    )
    assert seen == [wanted]
    assert torch.get_num_threads() == before  # put back for the rest of the process
    environment = json.loads((result.run_dir / "environment.json").read_text())
    assert environment["torch_threads"] == wanted
    assert environment["torch_threads_reason"] == f"train.threads={wanted}"
