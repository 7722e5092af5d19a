"""The small faults: YAML's `off`, the lock and forked workers, quoted commands."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import pytest

from stoker.checkpoint.lock import FolderLock
from stoker.config import load_config
from stoker.errors import ConfigError
from stoker.train.rundir import create_run_dir


def test_fingerprint_off_in_yaml_is_off(tmp_path: Path) -> None:
    # YAML 1.1 reads a bare `off` as false; the docs say `fingerprint: off`.
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  fingerprint: off\n")
    assert load_config(path).data.fingerprint == "off"
    path.write_text("data: {}\n")
    assert load_config(path, ["data.fingerprint=off"]).data.fingerprint == "off"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_worker_does_not_keep_the_lock_when_its_parent_dies(tmp_path: Path) -> None:
    """A DataLoader worker forked while the lock is held, orphaned by a kill -9 of the
    training process, must not keep the run dir locked: an immediate resume gets it."""
    lock = FolderLock(tmp_path)
    # Two pipes, one per direction: with one, the child could read back its own byte.
    ready_r, ready_w = os.pipe()  # child -> test: "forked"
    done_r, done_w = os.pipe()  # test -> child: "you may exit"
    pid = os.fork()
    if pid == 0:  # the "worker": outlives its parent for a while
        os.write(ready_w, b"x")
        os.read(done_r, 1)  # blocks until the test is done
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        # The training process dies without unlocking: its copy of the fd just closes.
        assert lock._finalizer is not None
        lock._finalizer.detach()
        os.close(lock._fd)  # type: ignore[arg-type]
        FolderLock(tmp_path).release()  # before: "locked by pid …, which has exited"
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)


def test_the_already_a_run_hint_quotes_the_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "my runs" / "run 1"
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text("name: x\n")
    with pytest.raises(ConfigError) as info:
        create_run_dir(run_dir, root=tmp_path, name="x")
    assert f"--resume {shlex.quote(str(run_dir))}," in str(info.value)


if sys.platform == "win32":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="POSIX only")


def test_float64_arrays_given_to_fit_are_cast_to_the_model_dtype_with_one_note(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import numpy as np
    import torch

    import stoker

    features = np.random.default_rng(0).standard_normal((64, 8))  # NumPy's float64
    targets = features[:, :1] * 2.0
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    with caplog.at_level("WARNING", logger="stoker"):
        result = stoker.fit(model, (features, targets), epochs=1, batch_size=32, loss="mse",
                            run_dir=tmp_path, progress="quiet", tensorboard=False)  # fmt: skip
    assert result.history and np.isfinite(result.metrics["train/loss"])
    notes = [r.message for r in caplog.records if "float64" in r.message]
    assert notes == [
        "fit: train_data holds float64 arrays and the model is float32: cast to float32 once, "
        "up front (pass float32 arrays to skip the copy)"
    ]


def test_a_second_stop_signal_of_any_kind_stops_at_once() -> None:
    import signal

    from stoker.train.loop import StopRequest
    from stoker.train.resume import stop_on_signals

    stop = StopRequest()
    with stop_on_signals(stop):
        os.kill(os.getpid(), signal.SIGHUP)  # a closed terminal: a stop request, not death
        assert stop.signal_name == "SIGHUP"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)  # the second: at once


def test_a_float64_npy_source_trains_as_float32_with_one_note(tmp_path: Path) -> None:
    """NumPy saves float64 by default; the `npy` source of a run config reads such fields
    as float32 (a regression target too), where the first step ended in a dtype error."""
    import numpy as np
    import torch
    import yaml

    from stoker.data.memmap import NpyDataset
    from stoker_cli import run_cli

    rng = np.random.default_rng(0)
    features = rng.standard_normal((64, 4))  # float64
    np.save(tmp_path / "features.npy", features)
    np.save(tmp_path / "target.npy", features[:, :1] * 3.0)  # float64 regression target
    config = {
        "model": {"name": "mlp", "args": {"in_features": 4, "out_features": 1, "hidden": 8}},
        "data": {"train": {"name": "npy", "args": {"path": "."}}},
        "loader": {"batch_size": 16},
        "loss": {"name": "mse"},
        "train": {"epochs": 1},
        "tracking": {"tensorboard": False},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    done = run_cli("train", tmp_path / "run.yaml", "--run-dir", tmp_path / "run", "--quiet")
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "float64" in line]
    assert len(notes) == 1, done.stderr
    assert "features.npy, target.npy" in notes[0] and "read as float32" in notes[0]
    assert "float64: keep" in notes[0]

    cast = NpyDataset(tmp_path, float64="float32").__getitems__([3, 1])
    assert [t.dtype for t in cast] == [torch.float32, torch.float32]
    assert torch.equal(cast[0], torch.from_numpy(features[[3, 1]].astype(np.float32)))
    kept = NpyDataset(tmp_path).__getitems__([3, 1])  # Python's default: as stored
    assert [t.dtype for t in kept] == [torch.float64, torch.float64]
