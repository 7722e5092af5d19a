"""The README's Python example runs as written and trains (the docs cannot drift)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[2] / "README.md"


def test_readme_python_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    example = next(block for block in blocks if "stoker.fit(" in block)
    script = tmp_path / "example.py"
    script.write_text(example)
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert sum(line.startswith("epoch ") for line in lines) == 10  # stoker's progress lines
    result_line = next(i for i, line in enumerate(lines) if re.match(r"^[01]\.\d+ runs/", line))
    accuracy, run_dir = lines[result_line].split()
    assert float(accuracy) > 0.95  # label = sign of x0 + x1: an MLP learns it
    assert (tmp_path / run_dir / "metrics.jsonl").is_file()
    history = [line.split() for line in lines[result_line + 1 :]]
    assert [int(row[0]) for row in history] == list(range(1, 11))  # epochs count from 1
    assert all(len(row) == 6 for row in history)
