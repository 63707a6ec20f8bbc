"""The run report: one self-contained HTML page of inline SVG plots from ``metrics.jsonl`` (no
network, no JS needed), and optionally a PNG per plot (with matplotlib, the ``bench`` extra).

Works on a run that is still going: a half-written last line is left out, and the page says
when the last record was written. ``write_report(..., refresh_s=N)`` makes the page reload
itself every N seconds (for ``creditrl report --watch``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from creditrl.plain_text import as_html
from creditrl.report.metrics_log import MetricsLog, read_metrics
from creditrl.report.plots import PLOTS, PlotData, plot_data
from creditrl.report.svg import line_chart

__all__ = ["ReportFiles", "render_report", "write_pngs", "write_report"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em} .summary td,.summary th{text-align:left;padding:1px 10px 1px 0}
.grid{display:flex;flex-wrap:wrap;gap:18px}
.plot{border:1px solid #ddd;padding:6px} .plot p{font-size:.8em;color:#666;margin:2px 0;
 max-width:560px} .plot .missing{color:#b00;font-weight:bold}
.warn{color:#b00}
"""


@dataclass
class ReportFiles:
    """What ``write_report`` wrote, and notes for the user."""

    html: Path
    pngs: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: list[PlotData] = field(default_factory=list)


def _summary(log: MetricsLog, run_dir: Path, now: float) -> str:
    rows = [
        ("run", str(run_dir)),
        ("metrics", str(log.path)),
        ("records", str(len(log.records))),
        ("last step", str(log.last_step)),
    ]
    if log.last_time is not None:
        age = max(now - log.last_time, 0.0)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(log.last_time))
        rows.append(("last record", f"{stamp} ({age:.0f} s before this report)"))
    rows.append(("report written", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))))
    body = "".join(f"<tr><th>{k}</th><td>{as_html(v)}</td></tr>" for k, v in rows)
    warn = []
    if log.partial_last_line:
        warn.append("the last line is being written (run in progress): left out")
    warn += log.left_out()
    notes = "".join(f'<p class="warn">{as_html(w)}</p>' for w in warn)
    return f'<table class="summary">{body}</table>{notes}'


def _plot_html(data: PlotData) -> str:
    svg = line_chart(
        data.series,
        title=data.spec.title,
        x_label="step",
        y_label=data.spec.y_label,
        chart_id=f"plot-{data.spec.id}",
    )
    notes = ""
    if data.missing:
        notes += f'<p class="missing">missing: {as_html(", ".join(data.missing))}</p>'
    if data.absent:
        notes += f"<p>not logged in this run: {as_html('; '.join(data.absent))}</p>"
    return (
        f'<div class="plot" data-plot="{data.spec.id}" '
        f'data-missing="{as_html(",".join(data.missing))}">{svg}{notes}</div>'
    )


def render_report(
    run_dir: str | Path, refresh_s: float | None = None, now: float | None = None
) -> tuple[str, list[PlotData]]:
    """The report page of ``run_dir`` and the data of each plot."""
    page, plots, _ = _page(run_dir, refresh_s, now)
    return page, plots


def _page(
    run_dir: str | Path, refresh_s: float | None = None, now: float | None = None
) -> tuple[str, list[PlotData], MetricsLog]:
    run_dir = Path(run_dir)
    log = read_metrics(run_dir / "metrics.jsonl")
    now = time.time() if now is None else now
    plots = [plot_data(spec, log) for spec in PLOTS]
    refresh = f'<meta http-equiv="refresh" content="{refresh_s:g}">' if refresh_s else ""
    page = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">{refresh}'
        f"<title>creditrl report: {as_html(run_dir.name)}</title><style>{_CSS}</style>"
        f"</head><body><h1>creditrl report: {as_html(str(run_dir))}</h1>"
        f"{_summary(log, run_dir, now)}"
        f'<div class="grid">{"".join(_plot_html(p) for p in plots)}</div></body></html>'
    )
    return page, plots, log


def write_pngs(plots: Sequence[PlotData], out_dir: Path) -> list[Path]:
    """One PNG per plot with matplotlib; ImportError when matplotlib is not installed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for data in plots:
        fig, ax = plt.subplots(figsize=(6.4, 3.2), dpi=100)
        for s in data.series:
            xs = [x for x, _ in s.points()]
            ys = [y for _, y in s.points()]
            ax.plot(xs, ys, marker="o", markersize=3, label=s.name)
        ax.set_title(data.spec.title)
        ax.set_xlabel("step")
        ax.set_ylabel(data.spec.y_label)
        ax.grid(alpha=0.3)
        if len(data.series) > 1:
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out_dir / f"{data.spec.id}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    png: bool = True,
    refresh_s: float | None = None,
) -> ReportFiles:
    """Write ``out_dir/index.html`` (default ``run_dir/report``) and, with ``png`` and
    matplotlib installed, ``out_dir/<plot>.png``."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    page, plots, log = _page(run_dir, refresh_s)
    path = out / "index.html"
    tmp = out / ".index.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(path)
    files = ReportFiles(path, plots=plots)
    files.notes += [f"{log.path}: {said}" for said in log.left_out()]
    for data in plots:
        if data.missing:
            files.notes.append(f"{data.spec.title}: missing {', '.join(data.missing)}")
    if png:
        try:
            files.pngs = write_pngs(plots, out)
        except ImportError:
            files.notes.append("PNGs skipped: matplotlib is not installed (pip install matplotlib)")
    return files
