"""docs/own-code.md's Python snippets run as written (the page cannot drift from the code)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PAGE = Path(__file__).parents[2] / "docs" / "own-code.md"
#: The sections whose snippets this test runs (others may be added to the page later).
SECTIONS = (
    "## Callbacks",
    "## Your own optimizer and scheduler",
    "## Your own step",
    "## Metrics",
    "## A test split",
    "## Use a trained run",
)
EXAMPLES = Path(__file__).parents[2] / "examples"

RUNNER = """
import sys
for path in sys.argv[1:]:
    print("--- snippet", path, flush=True)
    exec(compile(open(path).read(), path, "exec"), {"__name__": "__main__"})
"""


def snippets() -> list[str]:
    text = PAGE.read_text()
    found = []
    for heading in SECTIONS:
        start = text.index(heading)
        end = text.find("\n## ", start + len(heading))
        found += re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)
    return found


@pytest.mark.slow  # six short trainings in a subprocess: ~20 s of CPU
def test_the_snippets_of_bring_your_own_code_run(tmp_path: Path) -> None:
    pytest.importorskip("torchmetrics")  # the metrics snippet's metric object
    # The snippets run from the repository's root: examples/digits.yaml, as there.
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "digits.yaml").write_text((EXAMPLES / "digits.yaml").read_text())
    paths = []
    for index, code in enumerate(snippets()):
        path = tmp_path / f"snippet{index}.py"
        path.write_text(code)
        paths.append(str(path))
    assert len(paths) == 6
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *paths],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    printed = done.stdout.split("--- snippet")[1:]
    assert "mean loss" in printed[0]  # StopAtLoss stopped the run, saying why
    assert float(printed[1].split()[-1]) > 0  # the lr after StepLR
    assert "val/kind_accuracy" in printed[2]
    assert "test/f1" in printed[4]  # result.test_metrics
    assert "eval/accuracy" in printed[5] and "100 predictions in preds.parquet" in printed[5]
