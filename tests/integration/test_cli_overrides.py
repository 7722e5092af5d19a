"""The command line as people type it: overrides anywhere after the config, extending a
run, a printed resume command that works, subcommand usage, and paths from the config."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from stoker.cli.main import main
from stoker.components import build_datasets
from stoker.config import load_config
from stoker.errors import DataError
from stoker_cli import run_cli

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "digits.yaml"
MODELS = """\
from torch import nn


def Net(hidden: int = 8):
    return nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Dropout(0.2), nn.Linear(hidden, 2))
"""


def make_project(root: Path) -> Path:
    """A config beside its models.py and data/, named by relative paths (no sklearn to load).

    Its lr is constant, a schedule that does not span the run's length: extendable exactly.
    """
    (root / "data").mkdir(parents=True)
    (root / "models.py").write_text(MODELS)
    features = torch.randn(80, 3, generator=torch.Generator().manual_seed(0))
    rows = [f"{a:.4f},{b:.4f},{c:.4f},{int(a > b)}" for a, b, c in features.tolist()]
    (root / "data" / "train.csv").write_text("a,b,c,label\n" + "\n".join(rows) + "\n")
    config = {
        "model": {"name": "models.py:Net"},
        "data": {
            "train": {"name": "csv", "args": {"path": "data/train.csv", "target": "label"}},
            "val_fraction": 0.2,
        },
        "loader": {"batch_size": 16},
        "train": {"epochs": 2},
        "tracking": {"tensorboard": False},
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    config["data"]["train"]["args"]["path"] = "data/missing.csv"
    (root / "broken.yaml").write_text(yaml.safe_dump(config))
    return root


# In-process (tests/stoker_cli.py): the subprocess path of `stoker train` is tested in
# test_cli.py and the zoo tests; here it would add ~4 s of start-up to each run.
stoker = run_cli


def epoch_records(run_dir: Path) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    return [r for r in records if "val/loss" in r]


def test_extending_a_finished_run_equals_the_longer_run_bitwise(tmp_path: Path) -> None:
    config = str(make_project(tmp_path / "project") / "run.yaml")
    straight, extended = tmp_path / "straight", tmp_path / "extended"
    done = stoker("train", config, "--run-dir", str(straight), "--quiet", "train.epochs=3")
    assert done.returncode == 0, done.stderr
    # The config says 2 epochs: the override after --run-dir is the one that counts.
    first = stoker("train", config, "--quiet", "--run-dir", str(extended), "train.epochs=1")
    assert first.returncode == 0, first.stderr
    assert len(epoch_records(extended)) == 1
    # Overrides after --resume, and between options: anywhere after CONFIG.
    more = stoker(
        "train",
        config,
        "--resume",
        str(extended),
        "seed=0",
        "--progress",
        "plain",
        "train.epochs=3",
    )
    assert more.returncode == 0, more.stderr
    assert "resuming" in more.stdout and "epoch 3/3" in more.stdout
    assert len(epoch_records(extended)) == 3
    a = load_file(straight / "model.safetensors")
    b = load_file(extended / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_the_printed_resume_command_works_as_printed(tmp_path: Path) -> None:
    config = str(make_project(tmp_path / "project") / "run.yaml")
    run_dir = tmp_path / "run dir"  # a space: the command must quote it
    shape = "model.args={hidden: 4}"  # a checkpoint of this shape loads only into this shape
    first = stoker(
        "train", config, "--run-dir", str(run_dir), "--progress", "plain", shape, "train.epochs=1"
    )
    assert first.returncode == 0, first.stderr
    line = next(x for x in first.stdout.splitlines() if x.startswith("resume:"))
    words = shlex.split(line.removeprefix("resume:"))
    # The overrides repeated, the run dir one word.
    expected = ["stoker", "train", config, "--resume", str(run_dir), shape, "train.epochs=1"]
    assert words == expected
    again = stoker(*words[1:], "--progress", "plain")
    assert again.returncode == 0, again.stderr
    assert f"resuming {run_dir} after epoch 1" in again.stdout


@pytest.mark.parametrize("command", ["train", "doctor", "tune", "explain"])
def test_a_bad_flag_shows_the_subcommand_usage(command: str, capsys) -> None:
    # Parsing fails before anything runs: in process, nothing global is touched.
    with pytest.raises(SystemExit) as info:
        main([command, str(EXAMPLE), "--bogus", "train.epochs=1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: stoker {command} ")
    assert f"stoker {command}: error: unrecognized arguments: --bogus" in err


def test_config_paths_resolve_from_its_folder_whatever_the_cwd(tmp_path: Path) -> None:
    project = make_project(tmp_path / "project")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = stoker("train", "../project/run.yaml", "--run-dir", "out", "--quiet", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    # --run-dir is typed on the command line: it resolves from the current folder.
    saved = yaml.safe_load((elsewhere / "out" / "config.yaml").read_text())
    assert saved["model"]["name"] == f"{project / 'models.py'}:Net"
    assert saved["data"]["train"]["args"]["path"] == str(project / "data" / "train.csv")
    assert saved["tracking"]["run_dir"] == str(elsewhere / "out")


def test_a_missing_data_file_is_named_by_its_resolved_path(tmp_path: Path) -> None:
    project = make_project(tmp_path / "project")
    config = load_config(project / "broken.yaml")
    with pytest.raises(DataError) as info:
        build_datasets(config)
    assert f"CSV file {project / 'data' / 'missing.csv'} does not exist" in str(info.value)
