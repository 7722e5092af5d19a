"""The README's Python example runs as written and trains (the docs cannot drift)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
from pathlib import Path

import torch

README = Path(__file__).parents[2] / "README.md"


def test_readme_python_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(block for block in blocks if "stoker.fit(" in block)
    script = tmp_path / "example.py"
    script.write_text(example)
    # Run as `python example.py` would, in this process (a fresh interpreter adds only its
    # start-up): from its folder, as __main__, one intra-op thread for a tiny model on a
    # busy machine. The autouse fixture gives back the cwd, threads and RNGs after it.
    os.chdir(tmp_path)
    torch.set_num_threads(1)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        runpy.run_path(str(script), run_name="__main__")
    lines = stdout.getvalue().strip().splitlines()
    assert sum(line.startswith("epoch ") for line in lines) == 10  # stoker's progress lines
    result_line = next(i for i, line in enumerate(lines) if re.match(r"^[01]\.\d+ runs/", line))
    accuracy, run_dir = lines[result_line].split()
    assert float(accuracy) > 0.95  # label = sign of x0 + x1: an MLP learns it
    assert (tmp_path / run_dir / "metrics.jsonl").is_file()
    history = [line.split() for line in lines[result_line + 1 :]]
    assert [int(row[0]) for row in history] == list(range(1, 11))  # epochs count from 1
    assert all(len(row) == 6 for row in history)


def test_the_first_steps_say_how_to_run_stoker_before_using_it() -> None:
    """`make demo` leaves `stoker` in .venv/bin, not on the PATH: say so where it is first used."""
    text = README.read_text()
    first_use = text.index("stoker demo ")  # the first `stoker ...` command line in the tour
    before = text[:first_use]
    assert ".venv/bin/stoker" in before
    assert "source .venv/bin/activate" in before


def test_every_example_config_is_listed_and_every_listed_one_exists() -> None:
    """The README's examples are the ones in examples/ (the exercises have their own page)."""
    root = README.parent
    text = README.read_text()
    named = set(re.findall(r"examples/[\w/.-]+\.yaml", text))
    assert named, "the README names no example config"
    missing = sorted(path for path in named if not (root / path).is_file())
    assert not missing, f"the README names configs that do not exist: {missing}"
    shipped = {
        path.relative_to(root).as_posix()
        for path in (root / "examples").rglob("*.yaml")
        if "exercises" not in path.parts
    }
    unlisted = sorted(shipped - named)
    assert not unlisted, f"example configs the README does not list: {unlisted}"
