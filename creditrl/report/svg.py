"""Self-contained SVG line charts (no plotting library, no network): for run reports (metrics
over steps) and explain pages (a quantity over token positions t).

Each series is a ``<g class="series" data-series=NAME data-points=N>`` holding one path per
run of consecutive known values (None/NaN break the line) and a circle per point with a
``<title>`` (the browser shows it on hover).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from creditrl.plain_text import as_html

__all__ = ["PALETTE", "Series", "fmt_number", "line_chart", "nice_ticks", "tick_labels"]

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)


@dataclass
class Series:
    """One line: ``ys[k]`` at ``xs[k]``; None or NaN is a gap."""

    name: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: str | None = None

    def points(self) -> list[tuple[float, float]]:
        """The known (x, y) pairs."""
        return [
            (float(x), float(y))
            for x, y in zip(self.xs, self.ys, strict=True)
            if y is not None and math.isfinite(float(y))
        ]


def fmt_number(v: float) -> str:
    """Compact label: up to 4 significant digits, scientific for very small or large values."""
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def tick_labels(ticks: Sequence[float]) -> list[str]:
    """Labels precise enough to tell neighbouring ticks apart (decimals from the tick step;
    scientific notation for tiny or huge values)."""
    if len(ticks) < 2:
        return [fmt_number(t) for t in ticks]
    step = abs(ticks[1] - ticks[0])
    biggest = max(abs(t) for t in ticks)
    if biggest >= 1e5 or biggest < 1e-3:
        digits = max(1, math.floor(math.log10(biggest)) - math.floor(math.log10(step)))
        return ["0" if t == 0 else f"{t:.{digits}e}" for t in ticks]
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    return [f"{t:.{decimals}f}" for t in ticks]


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round tick values covering [lo, hi] (steps of 1, 2 or 5 x 10^k)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return []
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9)
    last = math.floor(hi / step + 1e-9)
    return [0.0 if k == 0 else round(k * step, 12) for k in range(first, last + 1)]


def _range(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi == lo:
        pad = abs(lo) * 0.1 or 1.0
        return lo - pad, hi + pad
    pad = (hi - lo) * 0.05
    return lo - pad, hi + pad


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x_label: str,
    y_label: str = "",
    width: int = 560,
    height: int = 260,
    chart_id: str | None = None,
    shade: Sequence[tuple[float, float]] = (),
    marks: Sequence[tuple[float, str]] = (),
    zero_line: bool = True,
) -> str:
    """An SVG line chart. ``shade`` greys x-intervals (e.g. observation spans), ``marks`` draws
    labelled vertical lines (e.g. turn boundaries); a dashed line marks y = 0 when in range."""
    pts = [p for s in series for p in s.points()]
    xs_all = [float(x) for s in series for x in s.xs]
    x_lo, x_hi = (min(xs_all), max(xs_all)) if xs_all else (0.0, 1.0)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = _range([y for _, y in pts]) if pts else (-1.0, 1.0)
    y_ticks = nice_ticks(y_lo, y_hi)
    y_labels = tick_labels(y_ticks)
    widest = max((len(label) for label in y_labels), default=1)
    left, right, top, bottom = max(64, 30 + 6 * widest), 12, 28, 40
    legend_rows = math.ceil(len(series) / 3) if len(series) > 1 else 0
    top += 16 * legend_rows
    height += 16 * legend_rows
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * pw

    def sy(y: float) -> float:
        return top + (y_hi - y) / (y_hi - y_lo) * ph

    attrs = f' id="{as_html(chart_id)}"' if chart_id else ""
    out = [
        f'<svg class="chart" xmlns="http://www.w3.org/2000/svg"{attrs} '
        f'data-title="{as_html(title)}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">',
        f"<title>{as_html(title)}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
        f'<text x="{left}" y="16" font-size="13" font-weight="bold">{as_html(title)}</text>',
    ]
    for a, b in shade:
        x0, x1 = sx(max(a, x_lo)), sx(min(b, x_hi))
        out.append(
            f'<rect class="shade" x="{x0:.1f}" y="{top}" width="{max(x1 - x0, 1):.1f}" '
            f'height="{ph}" fill="#eee"/>'
        )
    for y, label in zip(y_ticks, y_labels, strict=True):
        out.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" '
            f'stroke="#e5e5e5"/><text x="{left - 6}" y="{sy(y) + 4:.1f}" font-size="10" '
            f'text-anchor="end">{label}</text>'
        )
    integer_x = all(float(x).is_integer() for x in xs_all)
    x_ticks = [x for x in nice_ticks(x_lo, x_hi, 8) if not integer_x or float(x).is_integer()]
    for x, label in zip(x_ticks, tick_labels(x_ticks), strict=True):
        out.append(
            f'<text x="{sx(x):.1f}" y="{top + ph + 14}" font-size="10" '
            f'text-anchor="middle">{label}</text>'
        )
    if zero_line and y_lo < 0 < y_hi:
        out.append(
            f'<line class="zero" x1="{left}" x2="{left + pw}" y1="{sy(0):.1f}" '
            f'y2="{sy(0):.1f}" stroke="#888" stroke-dasharray="4 3"/>'
        )
    for x, label in marks:
        out.append(
            f'<line class="mark" x1="{sx(x):.1f}" x2="{sx(x):.1f}" y1="{top}" y2="{top + ph}" '
            f'stroke="#555" stroke-dasharray="2 2"/><text x="{sx(x) + 2:.1f}" y="{top + 10}" '
            f'font-size="9" fill="#555">{as_html(label)}</text>'
        )
    out.append(
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>'
        f'<text x="{left + pw / 2:.1f}" y="{height - 6}" font-size="11" '
        f'text-anchor="middle">{as_html(x_label)}</text>'
    )
    if y_label:
        out.append(
            f'<text transform="translate(12 {top + ph / 2:.1f}) rotate(-90)" font-size="11" '
            f'text-anchor="middle">{as_html(y_label)}</text>'
        )
    for i, s in enumerate(series):
        out.append(_series_svg(s, s.color or PALETTE[i % len(PALETTE)], sx, sy, i))
        if legend_rows:
            lx, ly = left + (i % 3) * (pw / 3), 30 + 16 * (i // 3)
            color = s.color or PALETTE[i % len(PALETTE)]
            out.append(
                f'<g class="legend-item"><rect x="{lx:.1f}" y="{ly - 8}" width="10" '
                f'height="10" fill="{color}"/><text x="{lx + 14:.1f}" y="{ly + 1}" '
                f'font-size="10">{as_html(s.name)}</text></g>'
            )
    out.append("</svg>")
    return "".join(out)


def _series_svg(
    s: Series,
    color: str,
    sx: Callable[[float], float],
    sy: Callable[[float], float],
    order: int = 0,
) -> str:
    """The series' paths (split at gaps) and points; later series are drawn thinner, so series
    that coincide stay visible as nested lines and rings."""
    width, radius = max(2.8 - 0.5 * order, 1.0), max(3.6 - 0.6 * order, 1.6)
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(s.xs, s.ys, strict=True):
        if y is None or not math.isfinite(float(y)):
            if segments[-1]:
                segments.append([])
            continue
        segments[-1].append((float(x), float(y)))
    parts = [
        f'<g class="series" data-series="{as_html(s.name)}" '
        f'data-points="{len(s.points())}" fill="{color}" stroke="{color}">'
    ]
    for seg in segments:
        if len(seg) > 1:
            d = " ".join(
                f"{'M' if k == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}" for k, (x, y) in enumerate(seg)
            )
            parts.append(f'<path d="{d}" fill="none" stroke-width="{width:.1f}"/>')
    for x, y in s.points():
        parts.append(
            f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="{radius:.1f}" stroke="none">'
            f"<title>{as_html(s.name)} @ {fmt_number(x)}: {y:.6g}</title></circle>"
        )
    parts.append("</g>")
    return "".join(parts)
