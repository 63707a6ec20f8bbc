"""The explain page: one self-contained HTML file (inline CSS, JS, SVG; no network).

Per response: its tokens coloured by a chosen quantity on a diverging scale centred at 0 (red
positive, blue negative, white 0; the scale is ±max|value| over the page), observation spans
(mask 0) hatched and turn boundaries marked; hovering a token shows every value it has, a click
pins it; a line chart of the chosen quantity over t; the full per-token table. Then the legend.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from creditrl.inspect.columns import COLUMNS, INDEX_CONVENTION, NUMERIC, header
from creditrl.inspect.table import format_cell
from creditrl.inspect.view import TokenView
from creditrl.plain_text import as_html, plain
from creditrl.report.svg import Series, line_chart

__all__ = ["render_html", "write_html"]

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em} h2{font-size:1.1em;margin-top:1.6em}
.convention{max-width:60em;color:#444}
.controls{position:sticky;top:0;background:#fff;padding:.4em 0;border-bottom:1px solid #ddd;
 z-index:2}
.scale{display:inline-block;width:220px;height:12px;vertical-align:middle;margin:0 .4em;
 background:linear-gradient(90deg,rgb(31,119,180),#fff,rgb(214,39,40));border:1px solid #aaa}
.tokens{font-family:ui-monospace,Menlo,Consolas,monospace;line-height:2;white-space:pre-wrap;
 border:1px solid #ddd;padding:.6em;max-width:70em}
.tok{padding:2px 1px;border-radius:3px;cursor:pointer;border:1px solid transparent}
.tok:hover,.tok.pinned{border-color:#000}
.tok.unknown{outline:1px dotted #bbb}
.obs-span{background:repeating-linear-gradient(45deg,#eee,#eee 4px,#fff 4px,#fff 8px);
 border:1px dashed #999;border-radius:3px;padding:1px 0}
.obs-span .tok{color:#666}
.turn-mark{display:inline-block;font-size:.7em;color:#fff;background:#555;border-radius:3px;
 padding:0 4px;margin:0 3px;line-height:1.4;vertical-align:middle}
.settings,.notes{font-size:.85em;color:#444}
table{border-collapse:collapse;font-size:.8em}
td,th{border:1px solid #ddd;padding:2px 6px;text-align:right;white-space:nowrap}
td.text{text-align:left;font-family:ui-monospace,Menlo,Consolas,monospace}
tr.obs td{background:#f3f3f3;color:#777} tr.hl td{background:#ffe9a8}
.legend td{text-align:left;white-space:normal}
.tip{position:fixed;z-index:5;background:#fffff5;border:1px solid #333;padding:6px 8px;
 font-size:12px;box-shadow:2px 2px 6px rgba(0,0,0,.25);pointer-events:none;max-width:26em}
.tip table{font-size:12px} .tip td{border:none;padding:0 6px}
.qchart[hidden]{display:none}
"""

_JS = """
(function(){
const data = JSON.parse(document.getElementById('explain-data').textContent);
const select = document.getElementById('color-by');
const tip = document.getElementById('tip');
const fmt = (v, kind) => (v === null || v === undefined) ? '-' :
  (kind === 'int' ? String(v) : (v >= 0 ? '+' : '') + v.toFixed(6));
let pinned = null;
function color(v, m){
  if (v === null || v === undefined || !isFinite(v)) return '';
  const a = m > 0 ? Math.min(Math.abs(v) / m, 1) : 0;
  const c = v >= 0 ? [214,39,40] : [31,119,180];
  const mix = c.map(x => Math.round(255 + (x - 255) * a));
  return 'rgb(' + mix.join(',') + ')';
}
function recolor(){
  const q = select.value;
  let m = 0;
  data.views.forEach(v => (v.columns[q] || []).forEach((x, k) => {
    if (x !== null && isFinite(x) && (!v.columns.mask || v.columns.mask[k] !== 0))
      m = Math.max(m, Math.abs(x));
  }));
  document.querySelectorAll('.tok').forEach(el => {
    const v = data.views[+el.dataset.view];
    const masked = v.columns.mask && v.columns.mask[+el.dataset.k] === 0;
    const x = (v.columns[q] || [])[+el.dataset.k];
    el.style.background = masked ? '' : color(x, m);
    el.classList.toggle('unknown', !masked && (x === null || x === undefined));
  });
  document.getElementById('scale-lo').textContent = fmt(-m);
  document.getElementById('scale-hi').textContent = fmt(m);
  document.querySelectorAll('.qchart').forEach(el => { el.hidden = el.dataset.q !== q; });
}
function show(el){
  const v = data.views[+el.dataset.view], k = +el.dataset.k;
  const rows = data.order.filter(n => n in v.columns || n === 'token').map(n => {
    const val = n === 'token' ? v.tokens[k] : fmt(v.columns[n][k], data.kinds[n]);
    return '<tr><td>' + data.headers[n] + '</td><td class="val" data-col="' + n + '">' +
      val.replace(/&/g,'&amp;').replace(/</g,'&lt;') + '</td></tr>';
  });
  const title = data.views[+el.dataset.view].title;
  tip.innerHTML = '<b>' + title.replace(/&/g,'&amp;').replace(/</g,'&lt;') + '</b><table>' +
    rows.join('') + '</table>';
  tip.hidden = false;
  const r = el.getBoundingClientRect();
  tip.style.left = Math.min(r.left, window.innerWidth - 320) + 'px';
  tip.style.top = (r.bottom + 6 + 260 > window.innerHeight ? Math.max(r.top - 266, 0)
                   : r.bottom + 6) + 'px';
  document.querySelectorAll('tr.hl').forEach(t => t.classList.remove('hl'));
  const row = document.querySelector('#view-' + el.dataset.view + ' tr[data-k="' + k + '"]');
  if (row) row.classList.add('hl');
}
document.querySelectorAll('.tok').forEach(el => {
  el.addEventListener('mouseenter', () => { if (!pinned) show(el); });
  el.addEventListener('mouseleave', () => { if (!pinned) tip.hidden = true; });
  el.addEventListener('click', ev => {
    ev.stopPropagation();
    if (pinned) pinned.classList.remove('pinned');
    pinned = pinned === el ? null : el;
    if (pinned) { pinned.classList.add('pinned'); show(el); }
  });
});
document.addEventListener('click', () => {
  if (pinned) { pinned.classList.remove('pinned'); pinned = null; tip.hidden = true; }
});
select.addEventListener('change', recolor);
recolor();
})();
"""


def _token_html(view: TokenView, i: int) -> str:
    """The token strip: spans per token, observation runs wrapped, turn marks inserted."""
    out: list[str] = []
    in_obs = False
    prev_turn = None
    for k, text in enumerate(view.tokens):
        turn = view.value("turn", k)
        mask = view.value("mask", k)
        if turn is not None and turn != prev_turn and turn > 0:
            if in_obs:
                out.append("</span>")
                in_obs = False
            out.append(f'<span class="turn-mark" data-turn="{turn}">turn {turn}</span>')
            prev_turn = turn
        if mask == 0 and not in_obs:
            out.append('<span class="obs-span" title="observation / tool tokens (mask 0)">')
            in_obs = True
        elif mask != 0 and in_obs:
            out.append("</span>")
            in_obs = False
        shown = text.replace("\n", "↵\n") if text else "∅"
        out.append(
            f'<span class="tok" data-view="{i}" data-k="{k}" tabindex="0">{as_html(shown)}</span>'
        )
    if in_obs:
        out.append("</span>")
    return "".join(out)


def _spans(view: TokenView) -> tuple[list[tuple[float, float]], list[tuple[float, str]]]:
    """Observation intervals (in t) and turn boundaries, for the charts."""
    shade, marks = [], []
    prev_turn = None
    for k in range(len(view.tokens)):
        t = k + 1
        if view.value("mask", k) == 0:
            shade.append((t - 0.5, t + 0.5))
        turn = view.value("turn", k)
        if turn is not None and turn > 0 and turn != prev_turn:
            if prev_turn is not None:
                marks.append((t - 0.5, f"turn {turn}"))
            prev_turn = turn
    return shade, marks


def _charts(view: TokenView, i: int, quantities: list[str], chosen: str) -> str:
    shade, marks = _spans(view)
    parts = []
    ts = list(range(1, len(view.tokens) + 1))
    for q in quantities:
        if q not in view.columns:
            continue
        ys = [
            None if view.value("mask", k) == 0 else view.value(q, k)
            for k in range(len(view.tokens))
        ]
        svg = line_chart(
            [Series(header(q), ts, ys)],
            title=f"{header(q)} over t",
            x_label="t (response position)",
            width=720,
            height=200,
            chart_id=f"chart-{i}-{q}",
            shade=shade,
            marks=marks,
        )
        hidden = "" if q == chosen else " hidden"
        parts.append(f'<div class="qchart" data-q="{q}"{hidden}>{svg}</div>')
    return "".join(parts)


def _table(view: TokenView) -> str:
    names = view.present()
    head = "".join(f'<th title="{as_html(n)}">{as_html(header(n))}</th>' for n in names)
    rows = []
    for k in range(len(view.tokens)):
        cls = ' class="obs"' if view.value("mask", k) == 0 else ""
        cells = "".join(
            f'<td class="{"text" if n == "token" else "num"}" data-col="{n}">'
            f"{as_html(format_cell(n, view.value(n, k)))}</td>"
            for n in names
        )
        rows.append(f'<tr data-k="{k}"{cls}>{cells}</tr>')
    return f'<table class="token-table"><tr>{head}</tr>{"".join(rows)}</table>'


def _shown(view: TokenView) -> dict[str, object]:
    """``view.as_dict()`` for the page's script: title, prompt and notes as ``plain`` text, the
    tokens as their table cells (quoted, control characters escaped)."""
    data = view.as_dict()
    data["title"] = plain(view.title)
    data["prompt"] = None if view.prompt is None else plain(view.prompt)
    data["notes"] = [plain(n) for n in view.notes]
    data["tokens"] = [format_cell("token", t) for t in view.tokens]
    return data


def render_html(
    views: Sequence[TokenView], color_by: str = "advantage", title: str = "creditrl explain"
) -> str:
    """The page as a string. ``color_by``: a numeric column name (falls back to the first
    numeric column the views have when absent)."""
    if not views:
        raise ValueError("nothing to explain: no views")
    have = {name for v in views for name in v.present()}
    quantities = [q for q in NUMERIC if q in have]
    if color_by not in COLUMNS or COLUMNS[color_by].kind != "float":
        raise ValueError(f"--color-by {color_by!r} is not a numeric column; choose from {NUMERIC}")
    chosen = color_by if color_by in quantities else (quantities[0] if quantities else color_by)
    options = "".join(
        f'<option value="{q}"{" selected" if q == chosen else ""}>{as_html(header(q))} '
        f"({q})</option>"
        for q in quantities
    )
    sections = []
    for i, view in enumerate(views):
        prompt = (
            f"<details><summary>prompt</summary><pre>{as_html(view.prompt)}</pre></details>"
            if view.prompt
            else ""
        )
        settings = ", ".join(f"{k}={v}" for k, v in view.settings.items())
        notes = "".join(f"<li>{as_html(n)}</li>" for n in view.notes)
        sections.append(
            f'<section class="view" id="view-{i}" data-view="{i}">'
            f"<h2>{as_html(view.title)}</h2>{prompt}"
            f'<div class="settings">{as_html(settings)}</div>'
            f'<ul class="notes">{notes}</ul>'
            f'<div class="tokens">{_token_html(view, i)}</div>'
            f'<div class="charts">{_charts(view, i, quantities, chosen)}</div>'
            f"<details open><summary>per-token table</summary>{_table(view)}</details>"
            "</section>"
        )
    legend_names = [n for n in COLUMNS if n in have]
    legend = "".join(
        f"<tr><th>{as_html(header(n))}</th><td>{as_html(n)}</td>"
        f"<td>{as_html(COLUMNS[n].meaning)}</td></tr>"
        for n in legend_names
    )
    payload = {
        "views": [_shown(v) for v in views],
        "order": legend_names,
        "headers": {n: header(n) for n in COLUMNS},
        "kinds": {n: c.kind for n, c in COLUMNS.items()},
    }
    # no "<" at all inside the script element: "</script>" would end it, and "<!--<script>"
    # would make the parser swallow the rest of the page; in JSON it only occurs in strings
    data = json.dumps(payload).replace("<", "\\u003c")
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{as_html(title)}</title><style>{_CSS}</style></head><body>"
        f"<h1>{as_html(title)}</h1>"
        f'<p class="convention">{as_html(INDEX_CONVENTION)}</p>'
        '<div class="controls"><label>colour tokens by <select id="color-by">'
        f"{options}</select></label> "
        '<span id="scale-lo"></span><span class="scale"></span><span id="scale-hi"></span> '
        "<small>(hover a token for all its values; click to pin)</small></div>"
        f"{''.join(sections)}"
        f'<section class="legend"><h2>legend</h2><table>{legend}</table>'
        f"<p>{as_html(INDEX_CONVENTION)}</p></section>"
        '<div id="tip" class="tip" hidden></div>'
        f'<script type="application/json" id="explain-data">{data}</script>'
        f"<script>{_JS}</script></body></html>"
    )


def write_html(views: Sequence[TokenView], path: str | Path, color_by: str = "advantage") -> Path:
    """Write ``render_html(views, color_by)`` to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(views, color_by), encoding="utf-8")
    return path
