"""The run report's charts: which metrics are plotted together, drawn as inline SVG."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

__all__ = [
    "PHASES",
    "Bar",
    "Line",
    "curve_charts",
    "epoch_label",
    "finite",
    "format_number",
    "line_chart",
    "nice_ticks",
    "phase_chart",
    "stacked_bar_chart",
]

Record = Mapping[str, Any]
Point = tuple[float, float | None]

# The loop's per-step phases, in step order; their per-epoch totals stack into one bar.
# (The names of stoker.observe.timing.PHASES, with ``communication``, recorded only by
# distributed runs; repeated so that a report never imports torch.)
PHASES = ("data_wait", "communication", "transfer", "forward", "backward", "optimizer")
INDEX_KEYS = frozenset({"step", "epoch", "nonfinite"})
_SPLIT_COLORS = {"train": "#1f77b4", "val": "#ff7f0e"}
_OTHER_COLORS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22")
_PHASE_COLORS = ("#d62728", "#8c564b", "#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd")
_REST_COLOR = "#bbbbbb"
_X_LABEL = "optimizer step (steps)"

# Drawing-surface size in SVG user units; the page scales the SVG to its column width.
WIDTH, HEIGHT = 640, 300
_LEFT, _RIGHT, _BOTTOM = 70, WIDTH - 16, HEIGHT - 46
_LEGEND_ROW_H = 18
# Approximate width of one legend character at 13px, to wrap legend rows without a browser.
_CHAR_W = 7.2
# Above this many points a series is drawn as a bare line; markers would only be noise.
_MAX_MARKERS = 60
# Above this many points a series keeps every k-th one, so a long run's page stays small.
MAX_POINTS = 4000


# --- numbers -------------------------------------------------------------------------------


def finite(value: Any) -> float | None:
    """A finite float, or None for null, NaN, inf and non-numbers (json reads NaN too)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def format_number(value: float) -> str:
    """A short, readable number: ``0.003``, ``1.5e-05``, ``23``, ``74,312``."""
    if value == 0:
        return "0"
    if 1000 <= abs(value) < 1e9:
        return f"{value:,.0f}"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.4g}"


def epoch_label(record: Record) -> str:
    """The epoch of a record, as written: records number epochs from 1, as progress does."""
    epoch = record.get("epoch")
    return str(epoch) if isinstance(epoch, int) and not isinstance(epoch, bool) else "?"


def nice_ticks(low: float, high: float, *, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 times a power of ten) that cover ``[low, high]``.

    The first tick is at or below ``low`` and the last at or above ``high``, so the
    ticks double as the axis domain.
    """
    low, high = min(low, high), max(low, high)
    if high == low:
        pad = abs(low) * 0.1 or 1.0
        low, high = low - pad, high + pad
    raw = (high - low) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if raw <= m * magnitude * (1 + 1e-9))
    start = math.floor(low / step + 1e-9) * step
    n = round((math.ceil(high / step - 1e-9) * step - start) / step)
    # round() strips the float noise of start + i * step (0.30000000000000004).
    return [round(start + i * step, 12) for i in range(n + 1)]


# --- drawing -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Line:
    """One series of a line chart.

    Attributes:
        key: The metric key (``train/loss``); becomes the path's ``data-series``.
        level: ``"step"`` or ``"epoch"``: which records the points come from.
        label: The legend text.
        points: ``(step, value)`` pairs in step order; ``None`` marks a non-finite value.
        color: A CSS color.
        dashed: Draw the line dashed.
        epochs: The epoch of each point (``epoch_label``), named in its tooltip; empty
            for a series whose tooltips name the step alone.
    """

    key: str
    level: str
    label: str
    points: Sequence[Point]
    color: str
    dashed: bool = False
    epochs: Sequence[str] = ()


@dataclass(frozen=True)
class Bar:
    """One stacked segment series: one value per category (``None`` where missing)."""

    key: str
    label: str
    values: Sequence[float | None]
    color: str


@dataclass(frozen=True)
class _Scale:
    """A linear map from a data interval onto a pixel interval (either direction)."""

    d0: float
    d1: float
    p0: float
    p1: float

    def __call__(self, value: float) -> float:
        return self.p0 + (value - self.d0) / ((self.d1 - self.d0) or 1.0) * (self.p1 - self.p0)


def _legend(entries: Sequence[tuple[str, str, str]]) -> tuple[str, float]:
    """Legend rows above the plot; returns the SVG and the y where the plot may start.

    Each entry is ``(label, color, kind)`` with kind ``line``, ``dashed``, ``box`` or ``mark``.
    """
    parts = ['<g class="legend">']
    x, y = _LEFT, 14
    for label, color, kind in entries:
        item_w = 42 + len(label) * _CHAR_W
        if x + item_w > _RIGHT and x > _LEFT:
            x, y = _LEFT, y + _LEGEND_ROW_H
        color = escape(color)
        if kind == "box":
            swatch = f'<rect x="{x}" y="{y - 9}" width="20" height="10" fill="{color}"/>'
        elif kind == "mark":
            swatch = _cross(x + 10, y - 4)
        else:
            dash = ' stroke-dasharray="5 3"' if kind == "dashed" else ""
            swatch = (
                f'<line x1="{x}" y1="{y - 4}" x2="{x + 20}" y2="{y - 4}" stroke="{color}" '
                f'stroke-width="2.5"{dash}/>'
            )
        parts.append(
            f'<g class="legend-item" data-legend-for="{escape(label)}">{swatch}'
            f'<text x="{x + 26}" y="{y}" class="legend-text">{escape(label)}</text></g>'
        )
        x += item_w
    return "".join(parts) + "</g>", y + _LEGEND_ROW_H


def _cross(x: float, y: float) -> str:
    return (
        f'<path class="nonfinite-mark" d="M{x - 4:.1f} {y - 4:.1f} L{x + 4:.1f} {y + 4:.1f} '
        f'M{x - 4:.1f} {y + 4:.1f} L{x + 4:.1f} {y - 4:.1f}" stroke="#c00" stroke-width="2"/>'
    )


def _axes(
    x: _Scale,
    y: _Scale,
    x_ticks: Sequence[tuple[float, str]],
    y_ticks: Sequence[float],
    *,
    x_label: str,
    y_label: str,
    top: float,
) -> str:
    parts = ['<g class="grid">']
    parts += [
        f'<line x1="{_LEFT}" y1="{y(v):.1f}" x2="{_RIGHT}" y2="{y(v):.1f}"/>' for v in y_ticks
    ]
    parts.append(
        f'</g><g class="axis axis-x"><line x1="{_LEFT}" y1="{_BOTTOM}" x2="{_RIGHT}" '
        f'y2="{_BOTTOM}"/>'
    )
    for value, text in x_ticks:
        px = x(value)
        parts.append(
            f'<line x1="{px:.1f}" y1="{_BOTTOM}" x2="{px:.1f}" y2="{_BOTTOM + 5}"/>'
            f'<text x="{px:.1f}" y="{_BOTTOM + 18}" text-anchor="middle">{escape(text)}</text>'
        )
    parts.append(
        f'<text class="axis-label" x="{(_LEFT + _RIGHT) / 2}" y="{HEIGHT - 6}" '
        f'text-anchor="middle">{escape(x_label)}</text></g><g class="axis axis-y">'
        f'<line x1="{_LEFT}" y1="{top}" x2="{_LEFT}" y2="{_BOTTOM}"/>'
    )
    for value in y_ticks:
        py = y(value)
        parts.append(
            f'<line x1="{_LEFT - 5}" y1="{py:.1f}" x2="{_LEFT}" y2="{py:.1f}"/><text '
            f'x="{_LEFT - 8}" y="{py + 4:.1f}" text-anchor="end">{format_number(value)}</text>'
        )
    middle = (top + _BOTTOM) / 2
    parts.append(
        f'<text class="axis-label" x="14" y="{middle:.1f}" text-anchor="middle" '
        f'transform="rotate(-90 14 {middle:.1f})">{escape(y_label)}</text></g>'
    )
    return "".join(parts)


def _figure(chart_id: str, title: str, svg_body: str, *, kind: str) -> str:
    chart_id, title = escape(chart_id), escape(title)
    return (
        f'<figure class="chart chart-{kind}" id="{chart_id}">'
        f'<figcaption id="{chart_id}-title">{title}</figcaption>'
        f'<svg class="chart-svg" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-labelledby="{chart_id}-title"><title>{title}</title>{svg_body}</svg></figure>'
    )


def line_chart(
    *, chart_id: str, title: str, x_label: str, y_label: str, lines: Sequence[Line]
) -> str:
    """One ``<figure>`` holding an SVG line chart of ``lines`` against the optimizer step.

    Each series is one ``<path class="series" data-series=KEY data-level=LEVEL>`` with one
    coordinate pair per finite value; a non-finite value breaks the line and gets a red
    cross at the top edge. Short series also get a circle per point (a single point
    would otherwise draw nothing).
    """
    values = [v for line in lines for _, v in line.points if v is not None]
    steps = [s for line in lines for s, _ in line.points]
    entries = [(ln.label, ln.color, "dashed" if ln.dashed else "line") for ln in lines]
    if len(values) < sum(len(line.points) for line in lines):
        entries.append(("non-finite value (NaN/inf)", "#c00", "mark"))
    legend, top = _legend(entries)
    x_ticks = nice_ticks(min(steps), max(steps))
    y_ticks = nice_ticks(min(values), max(values)) if values else [0.0, 1.0]
    x = _Scale(x_ticks[0], x_ticks[-1], _LEFT, _RIGHT)
    y = _Scale(y_ticks[0], y_ticks[-1], _BOTTOM, top)
    ticks = [(v, format_number(v)) for v in x_ticks]
    body = [legend, _axes(x, y, ticks, y_ticks, x_label=x_label, y_label=y_label, top=top)]
    body += [_series(line, x, y, top=top) for line in lines]
    return _figure(chart_id, title, "".join(body), kind="line")


def _series(line: Line, x: _Scale, y: _Scale, *, top: float) -> str:
    key, level = escape(line.key), escape(line.level)
    commands: list[str] = []
    markers: list[str] = []
    crosses: list[str] = []
    pen_down = False
    many = sum(v is not None for _, v in line.points) > _MAX_MARKERS
    for index, (step, value) in enumerate(line.points):
        where = f"step {format_number(step)}"
        if line.epochs:
            where = f"epoch {escape(line.epochs[index])} ({where})"
        if value is None:
            pen_down = False
            crosses.append(
                f'<g class="nonfinite" data-nonfinite-for="{key}"><title>{where}: '
                f"{key} not finite (NaN/inf)</title>{_cross(x(step), top + 5)}</g>"
            )
            continue
        px, py = x(step), y(value)
        commands.append(f"{'L' if pen_down else 'M'}{px:.2f} {py:.2f}")
        following = line.points[index + 1][1] if index + 1 < len(line.points) else None
        if not many or (not pen_down and following is None):
            markers.append(
                f'<circle cx="{px:.2f}" cy="{py:.2f}" r="3"><title>{where}: '
                f"{escape(line.label)} = {format_number(value)}</title></circle>"
            )
        pen_down = True
    dash = ' stroke-dasharray="6 4"' if line.dashed else ""
    color = escape(line.color)
    return (
        f'<path class="series" data-series="{key}" data-level="{level}" d="{" ".join(commands)}"'
        f' fill="none" stroke="{color}" stroke-width="2" stroke-linejoin="round"{dash}/>'
        f'<g class="markers" data-markers-for="{key}" data-level="{level}" fill="{color}">'
        f"{''.join(markers)}</g>{''.join(crosses)}"
    )


def stacked_bar_chart(
    *,
    chart_id: str,
    title: str,
    x_label: str,
    y_label: str,
    categories: Sequence[str],
    bars: Sequence[Bar],
) -> str:
    """One ``<figure>`` with a bar per category, its segments stacked in ``bars`` order.

    Each segment is a ``<rect class="segment" data-series=KEY data-category=CATEGORY>``.
    """
    count = max(len(categories), 1)
    totals = [sum(bar.values[i] or 0.0 for bar in bars) for i in range(len(categories))]
    legend, top = _legend([(bar.label, bar.color, "box") for bar in bars])
    y_ticks = nice_ticks(0.0, max(totals, default=0.0) or 1.0)
    y = _Scale(y_ticks[0], y_ticks[-1], _BOTTOM, top)
    # Category i is drawn in slot [i, i + 1) of a scale from slot index to pixels.
    x = _Scale(0.0, float(count), _LEFT, _RIGHT)
    stride = math.ceil(count / 20)  # at most ~20 labels on the axis
    ticks = [(i + 0.5, c) for i, c in enumerate(categories) if i % stride == 0]
    body = [legend, _axes(x, y, ticks, y_ticks, x_label=x_label, y_label=y_label, top=top)]
    width = max((_RIGHT - _LEFT) / count * 0.6, 1.0)
    for i, category in enumerate(categories):
        base, left = 0.0, x(i + 0.5) - width / 2
        for bar in bars:
            value = bar.values[i]
            if value is None or value <= 0:
                continue
            y_top, y_bottom = y(base + value), y(base)
            body.append(
                f'<rect class="segment" data-series="{escape(bar.key)}" '
                f'data-category="{escape(category)}" x="{left:.2f}" y="{y_top:.2f}" '
                f'width="{width:.2f}" height="{y_bottom - y_top:.2f}" fill="{escape(bar.color)}">'
                f"<title>epoch {escape(category)}: {escape(bar.label)} = "
                f"{format_number(value)}</title></rect>"
            )
            base += value
    return _figure(chart_id, title, "".join(body), kind="bar")


# --- which metrics go in which chart ------------------------------------------------------

# (chart id, title, y-axis label, series); a series is (key, level) and level "any"
# means the step records if they hold the key, else the epoch records.
_CHARTS: tuple[tuple[str, str, str, tuple[tuple[str, str], ...]], ...] = (
    (
        "chart-loss",
        "Loss",
        "loss (mean per sample)",
        (("train/loss", "step"), ("train/loss", "epoch"), ("val/loss", "epoch")),
    ),
    (
        "chart-accuracy",
        "Accuracy",
        "accuracy (fraction, 0–1)",
        (("train/accuracy", "any"), ("val/accuracy", "epoch")),
    ),
    ("chart-lr", "Learning rate", "learning rate (per step)", (("lr", "any"),)),
    (
        "chart-grad-norm",
        "Gradient norm",
        "gradient L2 norm, before clipping",
        (("grad/norm", "step"), ("grad/norm", "epoch")),
    ),
    (
        "chart-throughput",
        "Throughput",
        "throughput (samples/s)",
        (("throughput/samples_per_s", "step"), ("throughput/samples_per_s", "epoch")),
    ),
)
# Shown even without data (with a note): every training run records them.
_ALWAYS = frozenset({"chart-loss", "chart-lr", "chart-grad-norm", "chart-throughput"})
_UNITS = (
    ("_per_s", "per second"),
    ("_pct", "%"),
    ("_s", "seconds"),
    ("_ms", "milliseconds"),
    ("_mib", "MiB"),
    ("_gib", "GiB"),
)


def _numeric(records: Sequence[Record], key: str) -> bool:
    """Whether ``key`` holds numbers (nulls stand for non-finite numbers) in ``records``."""
    values = [r[key] for r in records if key in r]
    numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
    return bool(numbers) or (bool(values) and all(v is None for v in values))


def _line(key: str, level: str, records: Sequence[Record], color: str, **style: bool) -> Line:
    """The series of ``key`` in ``records``, thinned to about ``MAX_POINTS`` points.

    Points of epoch records name their epoch in the tooltip, as the phase chart does.
    """
    having = [r for r in records if key in r]
    points = [(float(r["step"]), finite(r[key])) for r in having]
    label = f"{key} ({'per logged step' if level == 'step' else 'per epoch'}"
    if len(points) > MAX_POINTS:
        stride = math.ceil(len(points) / MAX_POINTS)
        # Non-finite points are kept: they are few and they are what a reader looks for.
        kept = [
            i
            for i, p in enumerate(points)
            if i % stride == 0 or p[1] is None or i == len(points) - 1
        ]
        points, having = [points[i] for i in kept], [having[i] for i in kept]
        label += f", 1 point in {stride} shown"
    epochs = [epoch_label(r) for r in having] if level == "epoch" else []
    return Line(key, level, label + ")", points, color, epochs=epochs, **style)


def curve_charts(step_records: Sequence[Record], epoch_records: Sequence[Record]) -> list[str]:
    """The line charts of a run: the fixed ones, then one per (group, unit) of the rest.

    ``time/*`` phase totals are left to ``phase_chart``; string values are not plotted.
    """
    levels = {"step": step_records, "epoch": epoch_records}
    used = {"time/epoch_s", *(f"time/{phase}_s" for phase in PHASES)}
    figures = []
    for chart_id, title, y_label, series in _CHARTS:
        lines = []
        for key, level in series:
            used.add(key)
            if level == "any":
                level = "step" if any(key in r for r in step_records) else "epoch"
            if not _numeric(levels[level], key):
                continue
            split = key.split("/", 1)[0]
            color = _SPLIT_COLORS.get(split, _OTHER_COLORS[0])
            # Epoch values of a key that also has step values: same color, dashed.
            dashed = level == "epoch" and split != "val"
            lines.append(_line(key, level, levels[level], color, dashed=dashed))
        if lines:
            figures.append(
                line_chart(
                    chart_id=chart_id, title=title, x_label=_X_LABEL, y_label=y_label, lines=lines
                )
            )
        elif chart_id in _ALWAYS:
            keys = ", ".join(sorted({k for k, _ in series}))
            figures.append(
                f'<figure class="chart chart-empty" id="{chart_id}"><figcaption>{escape(title)}'
                f'</figcaption><p class="note empty">no values recorded for {escape(keys)}</p>'
                "</figure>"
            )
    groups: dict[tuple[str, str], list[Line]] = {}
    for level, records in levels.items():
        for key in dict.fromkeys(k for r in records for k in r):
            if key in used or key in INDEX_KEYS or not _numeric(records, key):
                continue
            group = key.split("/", 1)[0] if "/" in key else "other"
            unit = next((unit for end, unit in _UNITS if key.endswith(end)), "value")
            lines = groups.setdefault((group, unit), [])
            color = _OTHER_COLORS[len(lines) % len(_OTHER_COLORS)]
            lines.append(_line(key, level, records, color))
    for (group, unit), lines in groups.items():
        slug = "".join(c if c.isalnum() else "-" for c in f"{group}-{unit}".lower())
        title = f"{group}/*" if unit == "value" else f"{group}/* in {unit}"
        y_label = group if unit == "value" else f"{group} ({unit})"
        figures.append(
            line_chart(
                chart_id=f"chart-{slug}",
                title=title,
                x_label=_X_LABEL,
                y_label=y_label,
                lines=lines,
            )
        )
    return figures


def phase_chart(epoch_records: Sequence[Record]) -> str | None:
    """Stacked bars of each epoch's phase totals (``time/<phase>_s``), None without any.

    With ``time/epoch_s`` recorded, a last grey segment holds the rest of the epoch.
    """
    keys = {k for r in epoch_records for k in r}
    bars = [
        Bar(
            f"time/{phase}_s",
            f"{phase.replace('_', ' ')} (s)",
            [finite(r.get(f"time/{phase}_s")) for r in epoch_records],
            color,
        )
        for phase, color in zip(PHASES, _PHASE_COLORS, strict=True)
        if f"time/{phase}_s" in keys
    ]
    if "time/epoch_s" in keys:
        # The part of the epoch no phase timer covers: logging, progress, the Python loop.
        rest = []
        for i, record in enumerate(epoch_records):
            total = finite(record.get("time/epoch_s"))
            covered = sum(bar.values[i] or 0.0 for bar in bars)
            rest.append(None if total is None else max(total - covered, 0.0))
        bars.append(Bar("time/other_s", "rest of the epoch (s)", rest, _REST_COLOR))
    if not bars:
        return None
    return stacked_bar_chart(
        chart_id="chart-phase-time",
        title="Time per epoch, by phase",
        x_label="epoch (from 1)",
        y_label="time per epoch (s)",
        categories=[epoch_label(r) for r in epoch_records],
        bars=bars,
    )
