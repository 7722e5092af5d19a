"""Tests for stoker.observe.report and the `stoker report` subcommand."""

from __future__ import annotations

import argparse
import itertools
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from stoker.cli import report as report_cli
from stoker.errors import StokerError
from stoker.observe.report import read_metrics, render_report, write_report
from stoker.observe.report_charts import nice_ticks

STEP_LOSSES = [2.3, 2.1, 1.7, 1.9, 1.2, 0.9, 0.8]
CONFIG = "name: toy\ntrain:\n  epochs: 3\n  monitor: val/accuracy\n  monitor_mode: auto\n"


class _Elements(HTMLParser):
    """Every start tag of a page, as (tag, attributes)."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.elements.append((tag, dict(attrs)))


def elements(page: str, tag: str, **attrs: str) -> list[dict[str, str | None]]:
    parser = _Elements()
    parser.feed(page)
    wanted = {key.replace("_", "-"): value for key, value in attrs.items()}
    return [
        found
        for name, found in parser.elements
        if name == tag and all(found.get(k) == v for k, v in wanted.items())
    ]


def series_points(page: str, key: str, level: str) -> list[tuple[float, float]]:
    """The (x, y) pixel pairs of the one path drawn for ``key`` at ``level``."""
    (path,) = elements(page, "path", data_series=key, data_level=level)
    pairs = re.findall(r"[ML](-?[\d.]+) (-?[\d.]+)", path["d"] or "")
    return [(float(x), float(y)) for x, y in pairs]


def write_lines(path: Path, records: list[dict], *, tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")


def synthetic_records() -> list[dict]:
    """Seven step records and three epoch records, as the loop writes them (epochs from 1)."""
    records: list[dict] = []
    epoch_ends = {20: 1, 50: 2, 70: 3}
    for index, loss in enumerate(STEP_LOSSES):
        step = (index + 1) * 10
        epoch = 1 if step <= 20 else 2 if step <= 50 else 3
        records.append(
            {
                "epoch": epoch,
                "step": step,
                "train/loss": loss,
                "lr": 0.001 * (index + 1),
                "grad/norm": 0.5 + index / 10,
                "throughput/samples_per_s": 1000.0 + 10 * index,
            }
        )
        if step in epoch_ends:
            records.append(
                {
                    "epoch": epoch,
                    "train/loss": loss,
                    "train/accuracy": 0.4 + epoch / 10,
                    "lr": 0.001,
                    "grad/norm": 0.6,
                    "time/epoch_s": 2.0,
                    "time/data_wait_s": 0.5,
                    "time/forward_s": 0.7,
                    "time/step_s": 0.01,
                    "throughput/samples_per_s": 900.0,
                    "val/loss": [1.9, 1.1, 0.95][epoch - 1],
                    "val/accuracy": [0.6, 0.8, 0.7][epoch - 1],
                    "step": step,
                }
            )
    return records


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    (path / "config.yaml").write_text(CONFIG, encoding="utf-8")
    write_lines(path / "metrics.jsonl", synthetic_records())
    return path


def test_write_report_draws_one_point_per_record(run_dir: Path) -> None:
    path = write_report(run_dir)
    assert path == run_dir / "report.html"
    page = path.read_text(encoding="utf-8")
    points = series_points(page, "train/loss", "step")
    assert len(points) == len(STEP_LOSSES)
    assert len(series_points(page, "val/loss", "epoch")) == 3
    assert len(series_points(page, "val/accuracy", "epoch")) == 3
    assert len(series_points(page, "lr", "step")) == len(STEP_LOSSES)
    # Steps map left to right; a larger loss sits higher, i.e. at a smaller SVG y.
    xs = [x for x, _ in points]
    assert xs == sorted(xs) and len(set(xs)) == len(xs)
    by_value = [y for _, (_, y) in sorted(zip(STEP_LOSSES, points, strict=True))]
    assert by_value == sorted(by_value, reverse=True)


def test_every_chart_has_title_axis_labels_and_legend(run_dir: Path) -> None:
    page = render_report(run_dir)
    for chart_id in (
        "chart-loss",
        "chart-accuracy",
        "chart-lr",
        "chart-grad-norm",
        "chart-throughput",
        "chart-phase-time",
    ):
        start = page.index(f'id="{chart_id}"')
        figure = page[start : page.index("</figure>", start)]
        assert "<figcaption" in figure and "<title>" in figure, chart_id
        assert figure.count('class="axis-label"') == 2, chart_id
        assert 'class="legend-item"' in figure, chart_id
    assert "optimizer step (steps)" in page
    assert "throughput (samples/s)" in page


def test_phase_times_stack_per_epoch_and_every_time_key_is_listed(run_dir: Path) -> None:
    page = render_report(run_dir)
    for key in ("time/data_wait_s", "time/forward_s", "time/other_s"):
        segments = elements(page, "rect", data_series=key)
        assert [s["data-category"] for s in segments] == ["1", "2", "3"], key
    # 2.0 s epochs: 0.5 data wait + 0.7 forward leaves 0.8 s for the rest.
    other = elements(page, "rect", data_series="time/other_s")[0]
    forward = elements(page, "rect", data_series="time/forward_s")[0]
    assert float(other["height"]) == pytest.approx(float(forward["height"]) * 0.8 / 0.7, rel=1e-3)
    table = page[page.index('id="phases"') :]
    assert "<th>time/step_s</th>" in table and "<th>time/epoch_s</th>" in table


def test_status_shows_epochs_steps_and_best_monitored_metric(run_dir: Path) -> None:
    page = render_report(run_dir)
    status = page[page.index('id="status"') : page.index('id="summary"')]
    assert "3 of 3" in status
    assert "<td>70</td>" in status  # the last step
    # val/accuracy is maximized: 0.8 at the second epoch (step 50).
    assert "best val/accuracy (max)" in status
    assert "0.8 at epoch 2, step 50" in status


def status_of(page: str) -> str:
    return page[page.index('id="status"') : page.index('id="summary"')]


def test_the_best_epoch_is_the_one_the_run_chose(run_dir: Path) -> None:
    # summary.json holds the loop's own choice; the report names it, not a new argmax.
    training = {
        "epochs_done": 3,
        "epochs": 5,
        "stopped_early": True,
        "monitor": "val/loss",
        "mode": "min",
        "best_value": 1.1,
        "best_epoch": 2,
    }
    summary = {"verdict": "compute-bound", "training": training}
    (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    page = render_report(run_dir)
    status = status_of(page)
    assert "<td>best val/loss (min)</td><td>1.1 at epoch 2, step 50</td>" in status
    assert "3 of 3 (stopped early: val/loss stopped improving)" in status
    summary_part = page[page.index('id="summary"') : page.index('id="phases"')]
    assert "best_epoch" not in summary_part  # shown once, in the status


def test_without_a_summary_the_best_epoch_follows_min_delta(run_dir: Path) -> None:
    # A run still training: val/loss 1.9, 1.1, 0.95; 0.95 is within min_delta of 1.1.
    config = "train:\n  epochs: 3\n  monitor: val/loss\n  early_stopping:\n"
    (run_dir / "config.yaml").write_text(
        config + "    patience: 5\n    min_delta: 0.2\n", encoding="utf-8"
    )
    assert "<td>1.1 at epoch 2, step 50</td>" in status_of(render_report(run_dir))
    (run_dir / "config.yaml").write_text(config + "    patience: 5\n", encoding="utf-8")
    assert "<td>0.95 at epoch 3, step 70</td>" in status_of(render_report(run_dir))


def test_epoch_points_name_their_epoch(run_dir: Path) -> None:
    page = render_report(run_dir)
    assert "<title>epoch 2 (step 50): val/loss (per epoch) = 1.1</title>" in page
    assert "<title>step 50: train/loss (per logged step) = " in page


def test_config_is_escaped(run_dir: Path) -> None:
    evil = "<script>alert('x')</script>"
    (run_dir / "config.yaml").write_text(
        f'name: "{evil}"\nnote: "{evil}"\ntrain:\n  epochs: 3\n', encoding="utf-8"
    )
    records = synthetic_records()
    records[0][f"custom/{evil}"] = 1.0
    write_lines(run_dir / "metrics.jsonl", records)
    (run_dir / "summary.json").write_text(json.dumps({"verdict": evil}), encoding="utf-8")
    (run_dir / "environment.json").write_text(json.dumps({evil: evil}), encoding="utf-8")
    page = render_report(run_dir)
    assert "<script" not in page.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in page


def test_half_written_last_line_and_nulls_are_handled(run_dir: Path) -> None:
    records = synthetic_records()
    records[1]["train/loss"] = None
    records[1]["nonfinite"] = ["train/loss"]
    write_lines(run_dir / "metrics.jsonl", records, tail='{"epoch": 2, "step": 80, "train/lo')
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [n for n, _ in metrics.skipped] == [len(records) + 1]
    page = render_report(run_dir)
    assert len(series_points(page, "train/loss", "step")) == len(STEP_LOSSES) - 1
    assert len(elements(page, "g", data_nonfinite_for="train/loss")) == 1
    assert "skipped 1 line(s) of metrics.jsonl" in page
    assert "train/loss at step 20" in page


def test_a_resumed_run_replaces_the_steps_it_logged_again(run_dir: Path) -> None:
    first = synthetic_records()
    again = [dict(r, **{"train/loss": 0.1}) for r in first if r["step"] >= 50]
    write_lines(run_dir / "metrics.jsonl", [*first, *again])
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics.step_records] == [10, 20, 30, 40, 50, 60, 70]
    assert metrics.superseded == len(again)
    page = render_report(run_dir)
    assert len(series_points(page, "train/loss", "step")) == len(STEP_LOSSES)


def test_the_page_needs_no_network(run_dir: Path) -> None:
    (run_dir / "summary.json").write_text(
        json.dumps({"verdict": "compute-bound", "recommendation": "a larger batch"}),
        encoding="utf-8",
    )
    page = render_report(run_dir)
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<(script|link|img|iframe)\b", page, flags=re.I)
    assert "@import" not in page and "url(" not in page


@pytest.mark.parametrize("metrics_text", [None, "", '{"step": 1, "train/lo'])
def test_missing_or_empty_metrics_still_make_a_report(
    run_dir: Path, metrics_text: str | None
) -> None:
    metrics = run_dir / "metrics.jsonl"
    if metrics_text is None:
        metrics.unlink()
    else:
        metrics.write_text(metrics_text, encoding="utf-8")
    page = write_report(run_dir).read_text(encoding="utf-8")
    assert "no charts: metrics.jsonl" in page
    assert "no time/* metrics recorded" in page
    assert 'class="run-name">toy<' in page


def test_a_chart_without_values_says_so(run_dir: Path) -> None:
    records = [{"epoch": 1, "step": 5, "train/loss": 1.0}]
    write_lines(run_dir / "metrics.jsonl", records)
    page = render_report(run_dir)
    assert len(series_points(page, "train/loss", "step")) == 1
    assert len(elements(page, "circle")) >= 1  # one point needs a marker to be seen
    assert "no values recorded for lr" in page
    assert 'id="chart-accuracy"' not in page


def test_summary_json_is_rendered_when_present(run_dir: Path) -> None:
    page = render_report(run_dir)
    assert "no timing summary recorded" in page
    summary = {
        "verdict": "partly input-bound",
        "recommendation": "run `stoker tune CONFIG`",
        "data_stall_pct": 12.5,
        "phases": {
            "data_wait": {"median_ms": 1.5, "p95_ms": 2.0},
            "forward": {"median_ms": 4.0, "p95_ms": 5.5},
        },
    }
    (run_dir / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    page = render_report(run_dir)
    section = page[page.index('id="summary"') : page.index('id="charts"')]
    assert "<strong>partly input-bound</strong>" in section
    assert "run `stoker tune CONFIG`" in section
    assert "<td>data_stall_pct</td><td>12.5</td>" in section
    assert "<th>median_ms</th>" in section and "<td>forward</td><td>4</td><td>5.5</td>" in section


def test_environment_prefers_the_recorded_one(run_dir: Path) -> None:
    page = render_report(run_dir)
    section = page[page.index('id="environment"') :]
    assert "no environment.json" in section and "<td>torch</td>" in section
    (run_dir / "environment.json").write_text(
        json.dumps({"torch": "9.9.9", "cuda": {"device": "Fancy GPU"}}), encoding="utf-8"
    )
    section = render_report(run_dir)
    section = section[section.index('id="environment"') :]
    assert "recorded with the run (environment.json)" in section
    assert "<td>torch</td><td>9.9.9</td>" in section
    assert "<td>cuda.device</td><td>Fancy GPU</td>" in section


def test_missing_run_dir_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-run"
    with pytest.raises(StokerError, match="no-such-run"):
        write_report(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StokerError, match="holds no run"):
        write_report(tmp_path / "empty")


def test_out_may_be_a_file_or_a_folder(run_dir: Path, tmp_path: Path) -> None:
    assert write_report(run_dir, out=tmp_path / "a" / "r.html") == tmp_path / "a" / "r.html"
    folder = tmp_path / "reports"
    folder.mkdir()
    assert write_report(run_dir, out=folder) == folder / "report.html"
    assert (folder / "report.html").read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_cli_writes_the_report_and_prints_its_path(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    report_cli.add_parser(parser.add_subparsers(dest="command"), parents=[])
    out = tmp_path / "out.html"
    args = parser.parse_args(["report", str(run_dir), "--out", str(out)])
    assert args.run(args) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert 'id="chart-loss"' in out.read_text(encoding="utf-8")


def test_cli_open_hands_the_file_to_a_browser(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    opened: list[str] = []
    monkeypatch.setattr(report_cli.webbrowser, "open", lambda uri: opened.append(uri) or True)
    parser = argparse.ArgumentParser()
    report_cli.add_parser(parser.add_subparsers(dest="command"), parents=[])
    args = parser.parse_args(["report", str(run_dir), "--open"])
    assert args.run(args) == 0
    assert opened == [(run_dir / "report.html").resolve().as_uri()]
    assert capsys.readouterr().out.strip() == str(run_dir / "report.html")


def test_other_numeric_keys_get_charts_grouped_by_unit(run_dir: Path) -> None:
    records = synthetic_records()
    for record in records:
        if "val/loss" in record:
            record.update({"system/rss_mib": 300.0, "system/peak_rss_mib": 310.0})
            record.update({"system/cpu_pct": 90.0, "note": "text is not plotted"})
    write_lines(run_dir / "metrics.jsonl", records)
    page = render_report(run_dir)
    start = page.index('id="chart-system-mib"')
    figure = page[start : page.index("</figure>", start)]
    assert (
        'data-series="system/rss_mib"' in figure and 'data-series="system/peak_rss_mib"' in figure
    )
    assert 'data-series="system/cpu_pct"' not in figure
    assert len(series_points(page, "system/cpu_pct", "epoch")) == 3
    assert 'data-series="note"' not in page


def test_a_long_series_is_thinned(run_dir: Path) -> None:
    records = [{"epoch": 1, "step": s, "train/loss": 1 / s} for s in range(1, 10_002)]
    write_lines(run_dir / "metrics.jsonl", records)
    page = render_report(run_dir)
    points = series_points(page, "train/loss", "step")
    # Every 3rd of 10,001 points, plus the last one.
    assert len(points) == 3335
    assert "train/loss (per logged step, 1 point in 3 shown)" in page
    assert len(page) < 1_000_000


@pytest.mark.parametrize(
    ("low", "high"), [(0.0, 1.0), (0.52, 2.31), (1e-5, 3e-3), (23.0, 69.0), (5.0, 5.0)]
)
def test_nice_ticks_cover_the_range(low: float, high: float) -> None:
    ticks = nice_ticks(low, high)
    assert ticks[0] <= low and ticks[-1] >= high
    assert 2 <= len(ticks) <= 12
    gaps = {round(b - a, 12) for a, b in itertools.pairwise(ticks)}
    assert len(gaps) == 1
