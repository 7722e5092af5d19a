"""A scheduler's stop: SIGTERM to the whole process group of a CLI run with 2 loader workers.

systemd, Slurm and Kubernetes signal every process of the job, the loader workers too.
The run must save its stop-checkpoint and stop; the resume must equal an uninterrupted
run bit for bit. The same run dir (named with a space) also checks the printed resume
command and that a resume refuses to import code planted in the run dir. Two CLI
processes (stopped, resumed) and the uninterrupted reference run in-process.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from bitwise import assert_bitwise_equal
from stoker.checkpoint import find_latest, load_checkpoint
from stoker.cli.main import main
from stoker_cli import run_cli

pytestmark = pytest.mark.skipif(
    sys.platform == "win32", reason="needs process groups and POSIX signals"
)

STOKER = Path(sys.executable).with_name("stoker")


def _config(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    features = rng.standard_normal((384, 8)).astype(np.float32)
    np.save(tmp_path / "features.npy", features)
    np.save(tmp_path / "target.npy", (features[:, 0] > 0).astype(np.int64))
    config = {
        "name": "stop",
        "seed": 3,
        "model": {"name": "mlp", "args": {"in_features": 8, "out_features": 2, "hidden": [16]}},
        "data": {"train": {"name": "npy", "args": {"path": str(tmp_path)}}},
        "loader": {"batch_size": 16, "num_workers": 2, "shuffle": True},
        "loss": {"name": "cross_entropy"},
        "optim": {"name": "sgd", "lr": 0.05},
        "train": {"epochs": 2, "log_every_steps": 1},
        "tracking": {"tensorboard": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _start(*args: str | Path) -> subprocess.Popen:
    # A session (and so a process group) of its own: the group signal reaches only it.
    return subprocess.Popen(
        [str(STOKER), "train", *map(str, args), "--progress", "plain"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen) -> tuple[int, str]:
    _, err = process.communicate(timeout=300)
    return process.returncode, err


def _steps_logged(run_dir: Path) -> int:
    try:
        return (run_dir / "metrics.jsonl").read_text().count('"step"')
    except OSError:
        return 0


def _group(pgid: int) -> list[str]:
    """The processes of a process group: the run and its loader workers."""
    listed = subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True)
    return listed.stdout.split()


def _final_state(run_dir: Path) -> dict:
    bundle = load_checkpoint(find_latest(run_dir / "checkpoints"))
    keys = ("model", "optimizer", "scheduler", "train_state", "rng")
    return {key: bundle[key] for key in keys}


def test_group_sigterm_with_workers_stops_cleanly_and_resumes_bitwise(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _config(tmp_path)
    run_dir = tmp_path / "my runs" / "run 1"
    stopped = _start(config, "--run-dir", run_dir)
    deadline = time.monotonic() + 120
    workers: list[str] = []
    # Signal the group only once steps are logged and the loader workers are up (their
    # start and the first records race each other on an idle machine).
    while (_steps_logged(run_dir) < 3 or len(workers) < 3) and stopped.poll() is None:
        assert time.monotonic() < deadline, f"no steps with workers: {len(workers)} processes"
        time.sleep(0.05)
        workers = _group(stopped.pid)
    os.killpg(stopped.pid, signal.SIGTERM)
    code, err = _finish(stopped)

    assert len(workers) >= 3, "the run had no loader workers to signal"  # itself + 2
    assert code == 130, err
    assert "stopped by SIGTERM" in err and "checkpoint saved" in err, err
    assert "killed by signal" not in err and "Could not write" not in err, err
    # The printed resume command works as pasted: the run dir with a space is quoted.
    assert f"--resume {shlex.quote(str(run_dir))}" in err, err
    saved = load_checkpoint(find_latest(run_dir / "checkpoints"))
    assert saved["in_epoch"] is not None  # stopped mid-epoch, after the step it was in

    # A config in the run dir naming code in the run dir is not imported without a flag.
    planted = run_dir / "models.py"
    marker = tmp_path / "imported"
    planted.write_text(f"open({str(marker)!r}, 'w').close()\nNet = None\n")
    tampered = yaml.safe_load((run_dir / "config.yaml").read_text())
    tampered["model"] = {"name": "models.py:Net", "args": {}}
    (run_dir / "tampered.yaml").write_text(yaml.safe_dump(tampered))
    # In this process: the refusal comes before anything is built (no CLI start to pay).
    code = main(["train", str(run_dir / "tampered.yaml"), "--resume", str(run_dir)])
    refused = capsys.readouterr().err
    assert code == 2, refused
    assert str(planted) in refused and "--trust-run-code" in refused
    assert not marker.exists()

    resumed = subprocess.run(
        [str(STOKER), "train", str(config), "--resume", str(run_dir), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    # The uninterrupted run in this process (the same main; no interpreter and torch start).
    reference = run_cli("train", config, "--run-dir", tmp_path / "reference", "--quiet")
    assert reference.returncode == 0, reference.stderr
    assert_bitwise_equal(_final_state(tmp_path / "reference"), _final_state(run_dir))


FAILS_WITH_WORKERS = """
import torch, stoker
class Wide(torch.utils.data.Dataset):  # float64 samples: the model's first step fails
    def __len__(self): return 64
    def __getitem__(self, i): return torch.zeros(4, dtype=torch.float64), 0
stoker.fit(torch.nn.Linear(4, 2), Wide(), epochs=1, batch_size=8, num_workers=2,
           run_dir={run_dir!r}, progress="quiet", tensorboard=False, fingerprint="off")
"""


# A fresh interpreter (~3 s): multiprocessing's exit handler ends daemon children with
# SIGTERM, which the workers ignore (item 1), then joins them; stoker.data.worker_stop
# stops them first. Before that, a script whose fit raised mid-epoch never exited.
def test_a_run_that_fails_mid_epoch_with_workers_exits(tmp_path: Path) -> None:
    script = FAILS_WITH_WORKERS.format(run_dir=str(tmp_path / "run"))
    process = subprocess.Popen(
        [sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the script and its workers
        process.communicate()
        pytest.fail("the script raised, then hung at exit joining its loader workers")
    assert process.returncode == 1 and "ModelError" in err, err
