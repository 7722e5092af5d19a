"""The run report: one self-contained HTML page of a run's metrics, timing, config and setup."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

import yaml

from stoker.errors import StokerError
from stoker.observe.report_charts import (
    INDEX_KEYS,
    curve_charts,
    epoch_label,
    finite,
    format_number,
    phase_chart,
)
from stoker.observe.report_epochs import best_label, epochs_done_label, read_training
from stoker.safe_files import RunFileError, describe_os_error, write_text

__all__ = [
    "MetricsLog",
    "collect_environment",
    "read_metrics",
    "render_report",
    "write_report",
]

REPORT_NAME = "report.html"


@dataclass(frozen=True)
class MetricsLog:
    """The records of a ``metrics.jsonl``, split by level.

    Attributes:
        step_records: Records logged every few steps, in step order.
        epoch_records: One record per epoch (they hold ``time/epoch_s`` or ``val/*``).
        skipped: ``(line number, reason)`` for each line that could not be used.
        superseded: Records dropped because a resumed run logged the same steps again.
        exists: Whether the file was there at all.
    """

    step_records: tuple[dict[str, Any], ...]
    epoch_records: tuple[dict[str, Any], ...]
    skipped: tuple[tuple[int, str], ...]
    superseded: int
    exists: bool

    @property
    def empty(self) -> bool:
        """True when the log has no record at all (the run stopped before its first step)."""
        return not self.step_records and not self.epoch_records


def read_metrics(path: str | os.PathLike[str]) -> MetricsLog:
    """Reads a ``metrics.jsonl``, tolerating what a crash or a resume leaves behind.

    Unparsable lines (a half-written last line) and records without a numeric ``step``
    are skipped and listed. When steps go backwards (a run resumed from an earlier
    checkpoint logs those steps again), the later records replace the earlier ones.

    Args:
        path: The file; a missing file reads as no records.

    Returns:
        The records, split into step-level and epoch-level ones.
    """
    path = Path(path)
    if not path.is_file():
        return MetricsLog((), (), (), 0, exists=False)
    # "test": the one record of the end-of-run test, shown from summary.json.
    levels: dict[str, list[dict[str, Any]]] = {"step": [], "epoch": [], "test": []}
    skipped: list[tuple[int, str]] = []
    superseded = 0
    with path.open(encoding="utf-8", errors="replace") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                skipped.append((number, "not valid JSON (a line cut short by a crash?)"))
                continue
            step = record.get("step") if isinstance(record, dict) else None
            if not isinstance(step, int | float) or isinstance(step, bool):
                skipped.append((number, "no numeric 'step'"))
                continue
            kept = levels[_level(record)]
            while kept and kept[-1]["step"] >= step:
                kept.pop()
                superseded += 1
            kept.append(record)
    return MetricsLog(
        tuple(levels["step"]), tuple(levels["epoch"]), tuple(skipped), superseded, exists=True
    )


def _level(record: Mapping[str, Any]) -> str:
    if any(key.startswith("test/") for key in record):
        return "test"
    epoch_level = any(key == "time/epoch_s" or key.startswith("val/") for key in record)
    return "epoch" if epoch_level else "step"


def write_report(
    run_dir: str | os.PathLike[str], *, out: str | os.PathLike[str] | None = None
) -> Path:
    """Writes the self-contained HTML report of a run.

    The page needs no network: styles are inline and charts are inline SVG.

    Args:
        run_dir: The run dir (holds ``config.yaml``, ``metrics.jsonl``, ...).
        out: Where to write; a folder gets ``report.html`` inside. Default
            ``<run_dir>/report.html``.

    Returns:
        The path of the written report.

    Raises:
        StokerError: ``run_dir`` is missing or holds no run, or ``out`` cannot be written.
    """
    html_text = render_report(run_dir)
    # A path the user typed is followed (a link there is their choice); one in the run dir
    # is not.
    target = Path(run_dir) / REPORT_NAME if out is None else Path(out).resolve()
    if target.is_dir():
        target = target / REPORT_NAME
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        reason, fix = describe_os_error(error, target.parent)
        raise StokerError(f"cannot write the report to {target}: {reason}", hint=fix) from error
    try:
        # Written beside the target and renamed, so a reader never sees half a page; never
        # through a symlink planted at report.html.
        write_text(target, html_text)
    except RunFileError as error:
        # `stoker report` has --out; `stoker train` does not, so name the command in full.
        raise StokerError(
            f"cannot write the report: {error.message}",
            hint=f"{error.hint}; or write it elsewhere later with "
            f"`stoker report {shlex.quote(str(run_dir))} --out FILE`",
        ) from error
    return target


def render_report(run_dir: str | os.PathLike[str]) -> str:
    """The report of a run as one HTML string (see ``write_report``)."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise StokerError(
            f"run dir {run_dir} does not exist",
            hint="give the folder a run wrote (it holds config.yaml and metrics.jsonl)",
        )
    if not run_dir.is_dir():
        raise StokerError(
            f"{run_dir} is a file, not a run dir",
            hint=f"give the folder that holds it: stoker report {shlex.quote(str(run_dir.parent))}",
        )
    config_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    if not config_path.exists() and not metrics_path.exists():
        raise StokerError(
            f"{run_dir} holds no run: neither config.yaml nor metrics.jsonl is there",
            hint="give the folder a run wrote, e.g. runs/<name>-<timestamp>",
        )
    config_text, config = _read_config(config_path)
    metrics = read_metrics(metrics_path)
    name = str(config.get("name") or run_dir.name) if isinstance(config, dict) else run_dir.name
    environment = collect_environment()
    sections = [
        _status_section(run_dir, config, metrics, read_training(run_dir / "summary.json")),
        _summary_section(run_dir / "summary.json"),
        _phase_section(metrics),
        _charts_section(metrics),
        _config_section(config_text, config),
        _environment_section(run_dir / "environment.json", now=environment),
    ]
    return _page(name=name, run_dir=run_dir, version=environment["stoker"], sections=sections)


# --- sections ------------------------------------------------------------------------------


def _section(section_id: str, title: str, body: str) -> str:
    return f'<section id="{section_id}"><h2>{escape(title)}</h2>{body}</section>'


def _note(text: str, *, kind: str = "empty") -> str:
    return f'<p class="note {kind}">{escape(text)}</p>'


def _table(rows: Sequence[Sequence[Any]], *, header: Sequence[str] | None = None) -> str:
    head = ""
    if header:
        head = (
            "<thead><tr>" + "".join(f"<th>{escape(str(h))}</th>" for h in header) + "</tr></thead>"
        )
    body = "".join(
        "<tr>" + "".join(f"<td>{_cell(value)}</td>" for value in row) + "</tr>" for row in rows
    )
    return f'<div class="table-wrap"><table>{head}<tbody>{body}</tbody></table></div>'


def _cell(value: Any) -> str:
    if value is None:
        return '<span class="missing">–</span>'
    if isinstance(value, bool):
        return escape(str(value).lower())
    if isinstance(value, int | float):
        return escape(format_number(value)) if math.isfinite(value) else escape(str(value))
    if isinstance(value, dict | list):
        return f"<code>{escape(json.dumps(value, default=str))}</code>"
    return escape(str(value))


def _read_config(path: Path) -> tuple[str | None, Any]:
    if not path.is_file():
        return None, {}
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        return text, yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return text, None


def _status_section(
    run_dir: Path, config: Any, metrics: MetricsLog, training: Mapping[str, Any] | None
) -> str:
    train = config.get("train", {}) if isinstance(config, dict) else {}
    train = train if isinstance(train, dict) else {}
    epochs = metrics.epoch_records
    steps = [r["step"] for r in (*metrics.step_records, *epochs)]
    rows: list[tuple[str, Any]] = [
        ("run dir", str(run_dir.resolve())),
        ("epochs done", epochs_done_label(train, epochs, training)),
        ("optimizer steps", int(max(steps)) if steps else 0),
    ]
    metric, best = best_label(train, epochs, training)
    rows.append((f"best {metric}", best))
    parts = [_table(rows)]
    if epochs:
        last = epochs[-1]
        keys = sorted(k for k in last if k not in INDEX_KEYS and not isinstance(last[k], str))
        parts.append(f"<h3>Last epoch (epoch {epoch_label(last)})</h3>")
        parts.append(
            _table(
                [(k, finite(last[k]) if last[k] is not None else "non-finite") for k in keys],
                header=("metric", "value"),
            )
        )
    parts.extend(_warnings(metrics))
    return _section("status", "Status", "".join(parts))


def _warnings(metrics: MetricsLog) -> list[str]:
    warnings: list[tuple[str, str]] = []
    if not metrics.exists:
        warnings.append(("no metrics.jsonl in the run dir: nothing was logged", "warn"))
    elif metrics.empty:
        warnings.append(("metrics.jsonl holds no records yet", "warn"))
    if skipped := metrics.skipped:
        listed = "; ".join(f"line {n}: {why}" for n, why in skipped[:10])
        more = f" (and {len(skipped) - 10} more)" if len(skipped) > 10 else ""
        text = f"skipped {len(skipped)} line(s) of metrics.jsonl — {listed}{more}"
        warnings.append((text, "warn"))
    if metrics.superseded:
        text = f"{metrics.superseded} record(s) were logged again by a resumed run (later kept)"
        warnings.append((text, "info"))
    nonfinite = [
        (r["step"], str(key))
        for r in (*metrics.step_records, *metrics.epoch_records)
        if isinstance(r.get("nonfinite"), list)
        for key in r["nonfinite"]
    ]
    if nonfinite:
        listed = ", ".join(f"{key} at step {format_number(step)}" for step, key in nonfinite[:10])
        warnings.append((f"{len(nonfinite)} non-finite value(s) (NaN/inf): {listed}", "warn"))
    return [_note(text, kind=kind) for text, kind in warnings]


def _summary_section(path: Path) -> str:
    title = "Timing summary"
    if not path.is_file():
        return _section("summary", title, _note("no timing summary recorded (no summary.json)"))
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as error:
        return _section(
            "summary", title, _note(f"summary.json could not be read: {error}", kind="warn")
        )
    if not isinstance(data, dict):
        return _section("summary", title, _json_block(data))
    parts = []
    if "verdict" in data:
        parts.append(f'<p class="verdict">verdict: <strong>{_cell(data["verdict"])}</strong></p>')
    if "recommendation" in data:
        parts.append(f'<p class="recommendation">{_cell(data["recommendation"])}</p>')
    # "training" (epochs, best, early stopping) is shown in the status section.
    shown_elsewhere = ("verdict", "recommendation", "training")
    rest = {k: v for k, v in data.items() if k not in shown_elsewhere}
    scalars = [(k, v) for k, v in rest.items() if not isinstance(v, dict | list)]
    if scalars:
        parts.append(_table(scalars, header=("figure", "value")))
    for key, value in rest.items():
        if isinstance(value, dict | list):
            parts.append(f"<h3>{escape(str(key))}</h3>{_nested_table(value)}")
    return _section("summary", title, "".join(parts))


def _nested_table(value: dict | list) -> str:
    """A table for a mapping of mappings, a mapping, or a list of rows; JSON otherwise."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        columns = list(dict.fromkeys(c for v in value.values() for c in v))
        rows = [(k, *(v.get(c) for c in columns)) for k, v in value.items()]
        return _table(rows, header=("", *columns))
    if isinstance(value, dict):
        return _table(list(value.items()), header=("name", "value"))
    if value and all(isinstance(v, dict) for v in value):
        columns = list(dict.fromkeys(c for v in value for c in v))
        return _table([[v.get(c) for c in columns] for v in value], header=columns)
    if value and all(isinstance(v, list) for v in value):
        return _table(value)
    return _json_block(value)


def _json_block(value: Any) -> str:
    return f"<pre>{escape(json.dumps(value, indent=2, default=str))}</pre>"


def _charts_section(metrics: MetricsLog) -> str:
    title = "Training curves"
    if metrics.empty:
        why = "metrics.jsonl is missing" if not metrics.exists else "metrics.jsonl holds no records"
        return _section("charts", title, _note(f"no charts: {why}"))
    figures = curve_charts(metrics.step_records, metrics.epoch_records)
    return _section("charts", title, f'<div class="charts">{"".join(figures)}</div>')


def _phase_section(metrics: MetricsLog) -> str:
    title = "Where the time went, per epoch"
    epochs = [r for r in metrics.epoch_records if any(k.startswith("time/") for k in r)]
    if not epochs:
        return _section("phases", title, _note("no time/* metrics recorded"))
    keys = list(dict.fromkeys(k for r in epochs for k in r if k.startswith("time/")))
    rows = [(epoch_label(r), *(finite(r.get(k)) for k in keys)) for r in epochs]
    chart = phase_chart(epochs) or ""
    return _section("phases", title, chart + _table(rows, header=("epoch", *keys)))


def _config_section(text: str | None, config: Any) -> str:
    title = "Resolved config (config.yaml)"
    if text is None:
        return _section("config", title, _note("no config.yaml in the run dir"))
    if config is None:
        return _section(
            "config",
            title,
            _note("config.yaml is not valid YAML; shown as written", kind="warn")
            + f"<pre>{escape(text)}</pre>",
        )
    pretty = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=False)
    return _section("config", title, f'<pre class="config">{escape(pretty)}</pre>')


def _environment_section(path: Path, *, now: dict[str, Any]) -> str:
    title = "Environment"
    now = _flatten(now)
    recorded: dict[str, Any] | None = None
    note = ""
    if path.is_file():
        try:
            loaded = json.loads(path.read_text(encoding="utf-8", errors="replace"))
            recorded = _flatten(loaded) if isinstance(loaded, dict) else {"value": loaded}
        except json.JSONDecodeError as error:
            note = _note(f"environment.json could not be read: {error}", kind="warn")
    if recorded is None:
        note = note or _note(
            "no environment.json in the run dir: the values below are those "
            "of the machine that wrote this report, not necessarily the "
            "machine that trained",
            kind="info",
        )
        return _section(
            "environment", title, note + _table(list(now.items()), header=("", "at report time"))
        )
    keys = list(dict.fromkeys([*recorded, *now]))
    # A null in environment.json is a recorded "none" (no CUDA), not a missing entry.
    rows = [(k, _or_none(recorded, k), now.get(k)) for k in keys]
    header = ("", "recorded with the run (environment.json)", "at report time")
    return _section("environment", title, _table(rows, header=header))


def _or_none(values: Mapping[str, Any], key: str) -> Any:
    return ("none" if values[key] is None else values[key]) if key in values else None


def _flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def collect_environment() -> dict[str, Any]:
    """Python, torch and stoker versions, platform, CPUs and (torch imported) CUDA devices."""
    # Imported here: the stoker package imports the training stack, which may import this.
    from stoker import __version__

    env: dict[str, Any] = {
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "stoker": __version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    torch = sys.modules.get("torch")
    if torch is None:
        # `stoker report` alone: importing torch to ask about CUDA would take two seconds
        # (see stoker.cli.main); the installed version is in the package's metadata.
        try:
            env["torch"] = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            env["torch"] = "not installed"
        return env
    env["torch"] = torch.__version__
    env["cuda"] = torch.version.cuda or "none (CPU build)"
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [torch.cuda.get_device_name(i) for i in range(count)]
    except Exception as error:  # a broken driver must not cost the whole report
        names = [f"unavailable ({error})"]
    env["cuda_devices"] = ", ".join(names) if names else "none"
    return env


# --- page ----------------------------------------------------------------------------------

_CSS = """
:root { color-scheme: light; }
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
  margin: 0 auto; max-width: 1340px; padding: 16px 24px 48px; color: #222; background: #fff; }
h1 { font-size: 1.5rem; margin: 8px 0 2px; }
h2 { font-size: 1.15rem; border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 28px; }
h3 { font-size: 1rem; margin: 16px 0 6px; }
.sub { color: #666; margin: 0 0 8px; font-size: 0.9rem; }
nav a { margin-right: 12px; color: #1f5fa6; font-size: 0.9rem; }
.table-wrap { max-width: 100%; overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.88rem; margin: 6px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td { font-variant-numeric: tabular-nums; }
.missing { color: #999; }
pre { background: #f7f7f7; border: 1px solid #e2e2e2; padding: 10px; overflow: auto;
  font-size: 0.82rem; }
.note { padding: 6px 10px; border-left: 4px solid #bbb; background: #fafafa; }
.note.warn { border-color: #d62728; background: #fff4f4; }
.note.info { border-color: #1f77b4; background: #f3f8fd; }
.verdict { font-size: 1.1rem; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(560px, 1fr)); gap: 16px; }
figure.chart { margin: 0; border: 1px solid #e2e2e2; border-radius: 4px; padding: 8px; }
figure.chart-bar { max-width: 760px; }
figcaption { font-weight: 600; margin-bottom: 4px; }
svg.chart-svg { width: 100%; height: auto; display: block; font-size: 12px; }
svg .grid line { stroke: #eee; }
svg .axis line { stroke: #888; }
svg .axis text { fill: #444; }
svg .axis-label { fill: #222; font-size: 13px; }
svg .legend-text { fill: #222; font-size: 13px; }
"""


def _page(*, name: str, run_dir: Path, version: str, sections: Sequence[str]) -> str:
    stamp = dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
    links = "".join(
        f'<a href="#{sid}">{label}</a>'
        for sid, label in (
            ("status", "status"),
            ("summary", "timing summary"),
            ("phases", "phase times"),
            ("charts", "curves"),
            ("config", "config"),
            ("environment", "environment"),
        )
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>stoker report: {escape(name)}</title><style>{_CSS}</style></head><body>"
        f'<header><h1>stoker report: <span class="run-name">{escape(name)}</span></h1>'
        f'<p class="sub">run dir <code class="run-dir">{escape(str(run_dir))}</code> · '
        f"written {escape(stamp)} by stoker {escape(version)}</p><nav>{links}</nav></header>"
        f"<main>{''.join(sections)}</main></body></html>\n"
    )
