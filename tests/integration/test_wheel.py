"""The built wheel works installed, away from the repository.

A user installs the wheel into their own environment and runs stoker from their own
folder. This test builds the wheel from a copy of the files a release is built from,
installs it (without dependencies) into a new virtual environment whose dependencies,
torch among them, are the ones already installed for the tests — the "existing torch"
case, with nothing downloaded — and then, from an empty folder, runs what a new user
runs first. The wheel's own copy of stoker must be the one imported: if anything reached
back into the repository (examples, docs, data), it would fail here. The installed
`stoker` command runs the demo; `stoker.fit`, `train` and `doctor` then run in one
process through the CLI's `main` (each process start imports torch, ~4 s of CPU).

The full case — a fresh venv that resolves the wheel's dependencies from the package
index with a torch already installed — is `make wheel-check`, run by CI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RELEASE_FILES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "src")


def _run(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float = 300) -> str:
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done.stdout + done.stderr


def _build_wheel(tmp_path: Path) -> Path:
    """Build from a copy, so the build never writes build/ or egg-info into the checkout."""
    source = tmp_path / "source"
    source.mkdir()
    for name in RELEASE_FILES:
        origin = REPO / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, source / name)
    dist = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(source),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = dist.glob("stoker-*.whl")
    return wheel


def _venv_reusing_installed_packages(tmp_path: Path) -> Path:
    """A venv whose site-packages points at the test environment's packages (torch too)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # A plain path line: that folder's own .pth files (the editable install of the
    # checkout among them) are not processed, so the repository's src/ stays out.
    Path(purelib, "existing_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def test_the_wheel_works_installed_from_an_empty_folder(tmp_path: Path) -> None:
    wheel = _build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "stoker/py.typed" in names
    assert "stoker/examples/digits.yaml" in names

    venv = _venv_reusing_installed_packages(tmp_path)
    python, stoker = venv / "bin" / "python", venv / "bin" / "stoker"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["OMP_NUM_THREADS"] = "1"  # small models; a busy machine must not stretch them
    pip = [sys.executable, "-m", "pip", "--python", str(python)]
    _run(
        [*pip, "install", "-q", "--no-deps", "--ignore-installed", str(wheel)],
        cwd=tmp_path,
        env=env,
    )

    # The wheel's dependencies, extras included, are met by what is installed: nothing
    # to download, and the torch already there is kept.
    report = tmp_path / "report.json"
    _run(
        [*pip, "install", "--dry-run", "--no-index", "--report", str(report), f"{wheel}[all]"],
        cwd=tmp_path,
        env=env,
    )
    to_install = {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}
    assert "torch" not in to_install, to_install

    empty = tmp_path / "user-folder"
    empty.mkdir()
    # The example configs ship inside the package, where a user copies them from.
    (packaged,) = venv.glob("lib/python*/site-packages/stoker/examples/digits.yaml")
    shutil.copy(packaged, empty / "digits.yaml")

    # The `stoker` command as installed: its version, and the demo (the README's first run).
    out = _run([str(stoker), "demo", "--epochs", "1", "--run-dir", "demo-run"], cwd=empty, env=env)
    assert (empty / "demo-run" / "checkpoints").is_dir(), out
    assert "val/accuracy" in out
    version = _run([str(stoker), "--version"], cwd=empty, env=env).strip()

    # stoker.fit, `stoker train` on the packaged example and `stoker doctor`, all from
    # the wheel: one process (the CLI's own `main`), as each start imports torch again.
    script = (
        "import torch, stoker\n"
        "from stoker.cli.main import main\n"
        "print('FROM', stoker.__file__, stoker.__version__)\n"
        "x = torch.randn(256, 8); y = (x[:, 0] > 0).long()\n"
        "nn = torch.nn\n"
        "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))\n"
        "result = stoker.fit(model, (x, y), epochs=2, batch_size=32, lr=0.05, seed=0,"
        " run_dir='fit-run')\n"
        "print('RESULT', result.metrics['train/loss'])\n"
        "code = main(['train', 'digits.yaml', 'train.epochs=1', '--run-dir', 'train-run'])\n"
        "print('TRAIN EXIT', code, flush=True)\n"
        "code = main(['doctor', 'digits.yaml', '--seconds', '0.2', '--max-workers', '1',"
        " '--no-confirm'])\n"
        "print('DOCTOR EXIT', code)\n"
    )
    out = _run([str(python), "-c", script], cwd=empty, env=env)
    where = out.split("FROM ", 1)[1].split("\n", 1)[0]
    assert where.startswith(str(venv)), f"stoker imported from outside the new venv: {where}"
    assert version == f"stoker {where.split()[-1]}"
    assert "RESULT" in out
    assert (empty / "fit-run" / "metrics.jsonl").is_file()

    assert "TRAIN EXIT 0" in out, out
    summary = json.loads((empty / "train-run" / "summary.json").read_text())
    assert summary, "summary.json is empty"

    assert "DOCTOR EXIT 0" in out, out
    doctor_output = out.split("TRAIN EXIT 0", 1)[1].split("DOCTOR EXIT", 1)[0]
    assert "verdict" in doctor_output.lower(), out

    assert not (REPO / "runs").exists() or not any(
        p.stat().st_mtime > wheel.stat().st_mtime for p in (REPO / "runs").iterdir()
    ), "a run was written into the repository"


@pytest.mark.parametrize("name", ["LICENSE", "CHANGELOG.md"])
def test_release_files_exist_and_say_something(name: str) -> None:
    text = (REPO / name).read_text()
    assert len(text) > 500, f"{name} is missing or empty"
