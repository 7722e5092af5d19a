"""The CLI answers fast: the commands that need no training stack do not import torch.

Checked by what is imported, not by timing (timings on a shared machine are noise):
importing torch is most of a slow start (about two seconds), so torch absent from
``sys.modules`` after the command is the property that keeps ``stoker --help`` fast.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stoker
from stoker.cli.main import main
from stoker.errors import ConfigError

EXAMPLES = Path(__file__).parents[2] / "examples"

_SCRIPT = """
import contextlib, io, json, sys
from stoker.cli.main import main

codes = {}
for argv in ARGVS:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes[" ".join(argv)] = main(argv)
        except SystemExit as done:  # --help and --version exit from argparse
            codes[" ".join(argv)] = done.code
import stoker
names = [name for name in dir(stoker)]  # listing the package loads nothing
heavy = sorted(m for m in ("torch", "numpy", "safetensors") if m in sys.modules)
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def test_help_version_config_report_and_completion_do_not_import_torch(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 1, "train/loss": 0.5}) + "\n")
    config = str(EXAMPLES / "digits.yaml")
    argvs = [
        ["--help"],
        ["--version"],
        ["train", "--help"],
        ["predict", "--help"],
        ["config", "show", config, "train.epochs=2"],
        ["config", "validate", config],
        ["report", str(run_dir)],
        ["completion", "bash"],
    ]
    script = _SCRIPT.replace("ARGVS", repr(argvs))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["codes"].values()) == {0}, result["codes"]
    assert result["heavy"] == [], f"imported at start: {result['heavy']}"
    assert (run_dir / "report.html").is_file()


def test_train_reports_a_config_mistake_before_importing_torch(tmp_path: Path) -> None:
    config = str(EXAMPLES / "digits.yaml")
    argvs = [["train", config, "train.epochs=0"], ["train", str(tmp_path / "missing.yaml")]]
    script = _SCRIPT.replace("ARGVS", repr(argvs))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["codes"].values()) == {2}, result["codes"]
    assert "torch" not in result["heavy"]  # ~3 s of a 0.4 s answer


def test_data_inspect_of_csv_parquet_and_npy_does_not_import_torch(tmp_path: Path) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = np.arange(12, dtype=np.float32).reshape(6, 2)
    (tmp_path / "small.csv").write_text("a,b\n" + "".join(f"{a},{b}\n" for a, b in values))
    pq.write_table(pa.table({"a": values[:, 0], "b": values[:, 1]}), tmp_path / "small.parquet")
    np.save(tmp_path / "small.npy", values)
    names = ("small.csv", "small.parquet", "small.npy")
    argvs = [["data", "inspect", str(tmp_path / name)] for name in names]
    script = _SCRIPT.replace("ARGVS", repr(argvs))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["codes"].values()) == {0}, result["codes"]
    assert "torch" not in result["heavy"], f"imported by data inspect: {result['heavy']}"


def test_the_package_loads_its_names_on_first_use() -> None:
    assert stoker.__all__ == sorted(stoker.__all__)
    assert set(stoker.__all__) == {*stoker._EXPORTS, "__version__"}
    for name in stoker.__all__:
        assert getattr(stoker, name) is not None, name
    from stoker import fit, load_model

    assert callable(fit) and callable(load_model)
    assert set(stoker.__all__) <= set(dir(stoker))
    with pytest.raises(AttributeError, match="no attribute 'fitt'"):
        stoker.fitt  # noqa: B018


def test_config_show_prints_the_resolved_config(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    config = EXAMPLES / "images" / "digits.yaml"
    assert main(["config", "show", str(config), "train.epochs=7"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["train"]["epochs"] == 7
    assert shown["loader"]["num_workers"] == 0  # a default filled in
    # A path in the file resolves from the file's folder, as a run reads it.
    assert shown["model"]["name"] == f"{config.parent.absolute() / 'models.py'}:SmallCNN"


def test_a_pipe_closed_early_ends_the_command_quietly() -> None:
    """``stoker config show X | head -2``: the reader leaves before all is written; no
    BrokenPipeError traceback follows, and the exit code is 141 as for other tools."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: EPIPE every time
    try:
        done = subprocess.run(
            [sys.executable, "-m", "stoker", "config", "show", str(EXAMPLES / "text.yaml")],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 141


def test_config_validate_lists_every_problem_and_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = str(EXAMPLES / "digits.yaml")
    assert main(["config", "validate", config]) == 0
    assert "valid" in capsys.readouterr().out
    assert main(["config", "validate", config, "train.epochs=0", "loader.batch_size=x"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err and "train.epochs=0" in err and "loader.batch_size=x" in err
    with pytest.raises(ConfigError):
        main(["config", "validate", "--debug", config, "train.epochs=0"])


@pytest.mark.parametrize("shell", ["bash", "zsh"])
def test_completion_script_knows_the_commands_and_flags(
    shell: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["completion", shell]) == 0
    script = capsys.readouterr().out
    for word in ("predict", "evaluate", "--which", "--resume", "completion"):
        assert word in script, word
    # Path arguments complete as files (bash: shtab's file completer; zsh: _files).
    assert ("_shtab_compgen_files" if shell == "bash" else "_files") in script


_LAUNCHER_SCRIPT = """
import json, sys
import stoker.cli.train as train_command
from stoker.cli.main import main

launched = []
train_command._launch = lambda args, config: launched.append(args.nproc) or 0
code = main(["train", CONFIG, "--nproc", "2"])
launcher = sorted(m for m in HEAVY if m in sys.modules)
import stoker.train.session
trainer = sorted(m for m in HEAVY if m in sys.modules)
print(json.dumps({"code": code, "launched": launched, "launcher": launcher, "trainer": trainer}))
"""


def test_the_launcher_and_a_training_process_import_only_what_they_use() -> None:
    # Every `--nproc` launch starts a launcher and a process per rank, each paying its
    # imports: the launcher trains nothing (no training session), and only FSDP runs need
    # torch.distributed.checkpoint (~1 s of CPU: DTensor, sympy) — not every process.
    heavy = ("stoker.train.session", "torch.distributed.checkpoint")
    script = _LAUNCHER_SCRIPT.replace("CONFIG", repr(str(EXAMPLES / "digits.yaml")))
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script.replace("HEAVY", repr(heavy)))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 0 and result["launched"] == [2], result
    assert result["launcher"] == [], f"imported by the launcher: {result['launcher']}"
    assert result["trainer"] == ["stoker.train.session"], result["trainer"]
