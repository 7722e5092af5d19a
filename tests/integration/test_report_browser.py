"""A report of a real run, opened in headless Chromium: the charts are there and drawn."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from stoker.observe.report import write_report
from stoker_cli import run_cli

# Chart colors (report_charts.py): train blue, val orange, data-wait red (at least in the
# legend); the phase-time bars fill a large area with the phase colors.
TRAIN_BLUE = (31, 119, 180)
VAL_ORANGE = (255, 127, 14)
DATA_WAIT_RED = (214, 39, 40)
PHASE_COLORS = (DATA_WAIT_RED, VAL_ORANGE, TRAIN_BLUE, (44, 160, 44), (148, 103, 189))


def find_chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no chromium on PATH; `make test` installs Debian's chromium (apt-get install)")


def chromium(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Runs headless Chromium with everything that would reach the network switched off."""
    command = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=180)


class _Paths(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.series: dict[tuple[str | None, str | None], str] = {}
        self.figures: list[str | None] = []
        self.segments: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "path" and "data-series" in found:
            self.series[(found["data-series"], found.get("data-level"))] = found.get("d") or ""
        if tag == "rect" and "data-series" in found:
            self.segments.append(found)
        if tag == "figure":
            self.figures.append(found.get("id"))


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    find_chromium()  # no browser, no run to show it
    run_dir = tmp_path_factory.mktemp("browser") / "run"
    # In-process (test_cli.py runs the demo as a fresh process); process state restored.
    done = run_cli("demo", "--epochs", "2", "--run-dir", run_dir, "--quiet")
    assert done.returncode == 0, done.stderr
    return write_report(run_dir)


def test_browser_dom_holds_the_drawn_charts(report: Path, tmp_path: Path) -> None:
    browser = find_chromium()
    done = chromium(browser, tmp_path / "profile", "--dump-dom", report.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = _Paths()
    dom.feed(done.stdout)
    for chart in ("chart-loss", "chart-accuracy", "chart-lr", "chart-grad-norm"):
        assert chart in dom.figures, chart
    assert "chart-throughput" in dom.figures and "chart-phase-time" in dom.figures
    for key, level, least in (
        ("train/loss", "step", 3),
        ("val/loss", "epoch", 2),
        ("val/accuracy", "epoch", 2),
        ("lr", "step", 3),
        ("grad/norm", "step", 3),
        ("throughput/samples_per_s", "step", 3),
    ):
        drawn = re.findall(r"[ML]-?[\d.]+ -?[\d.]+", dom.series[(key, level)])
        assert len(drawn) >= least, (key, level, dom.series[(key, level)])
    rest = [s for s in dom.segments if s["data-series"] == "time/other_s"]
    assert [s["data-category"] for s in rest] == ["1", "2"]
    assert all(float(s["height"] or 0) > 0 for s in rest)


def test_screenshot_shows_the_charts(report: Path, tmp_path: Path) -> None:
    browser = find_chromium()
    shot = tmp_path / "report.png"
    done = chromium(
        browser,
        tmp_path / "profile",
        f"--screenshot={shot}",
        "--window-size=1200,2600",
        report.as_uri(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert shot.stat().st_size > 10_000
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2600)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # not a blank or single-color page
    counts = {rgb: count for count, rgb in colors}
    for rgb in (TRAIN_BLUE, VAL_ORANGE, DATA_WAIT_RED):
        assert counts.get(rgb, 0) > 30, rgb
    # Lines and legends alone color a few thousand pixels; two stacked bars, tens of thousands.
    assert sum(counts.get(rgb, 0) for rgb in PHASE_COLORS) > 15_000
