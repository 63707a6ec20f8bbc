"""Per-token tables in the terminal (rich) and as TSV, with the legend of every column shown."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from creditrl.inspect.columns import COLUMNS, INDEX_CONVENTION, header
from creditrl.inspect.view import TokenView
from creditrl.plain_text import as_text, plain

__all__ = ["format_cell", "legend_lines", "print_views", "tsv"]


def format_cell(name: str, value: Any) -> str:
    """A cell as text: "-" when unknown, floats with 6 decimals and a sign, tokens quoted (so
    spaces, newlines and control characters show)."""
    if value is None:
        return "-"
    if name == "token":
        return plain(json.dumps(value, ensure_ascii=False))
    kind = COLUMNS[name].kind if name in COLUMNS else "float"
    if kind == "int":
        return str(int(value))
    return f"{float(value) + 0.0:+.6f}"  # + 0.0 turns -0.0 into 0.0


def _columns(view: TokenView, only: Sequence[str] | None) -> list[str]:
    present = view.present()
    if not only:
        return present
    unknown = [c for c in only if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown column(s) {unknown}; choose from {list(COLUMNS)}")
    return [c for c in present if c in only or c in ("t", "token")]


def legend_lines(names: Sequence[str]) -> list[str]:
    """ "header: definition" for each column, then the index convention."""
    lines = [f"{header(n)} [{n}]: {COLUMNS[n].meaning}" for n in names if n in COLUMNS]
    return [*lines, INDEX_CONVENTION]


def _groups(names: list[str], cells: dict[str, list[str]], width: int) -> list[list[str]]:
    """Split columns into tables that fit ``width``; ``t`` and ``token`` lead every table."""
    lead = [n for n in names if n in ("t", "token")]
    rest = [n for n in names if n not in lead]

    def need(n: str) -> int:
        return max(len(header(n)), *(len(c) for c in cells[n])) + 3

    budget = width - sum(need(n) for n in lead) - 3
    groups: list[list[str]] = []
    used = budget + 1
    for name in rest:
        if used + need(name) > budget and (used > 0 or not groups):
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += need(name)
    return [lead + g for g in groups] or [lead]


def print_views(
    views: Sequence[TokenView],
    console: Console,
    columns: Sequence[str] | None = None,
    legend: bool = True,
) -> None:
    """One table per view (split into several when too wide for the console), its settings and
    notes, then the legend of the columns shown."""
    shown: list[str] = []
    for view in views:
        names = _columns(view, columns)
        shown += [n for n in names if n not in shown]
        cells = {
            n: [format_cell(n, view.value(n, k)) for k in range(len(view.tokens))] for n in names
        }
        if view.prompt:
            console.print(
                "[bold]prompt:[/bold]", as_text(json.dumps(view.prompt, ensure_ascii=False))
            )
        for part, group in enumerate(_groups(names, cells, console.width)):
            title = view.title if part == 0 else f"{view.title} (continued)"
            console.print(as_text(title, style="bold"))
            table = Table()
            for name in group:
                justify = "left" if name == "token" else "right"
                table.add_column(as_text(header(name)), justify=justify, no_wrap=True)
            for k in range(len(view.tokens)):
                table.add_row(*(as_text(cells[name][k]) for name in group))
            console.print(table)
        if view.settings:
            settings = ", ".join(f"{k}={v}" for k, v in view.settings.items())
            console.print(as_text(f"settings: {settings}"))
        for note in view.notes:
            console.print("[yellow]note:[/yellow]", as_text(note))
    if legend:
        console.print("[bold]legend[/bold]")
        for line in legend_lines(shown):
            console.print(as_text(f"  {line}"))


def tsv(views: Sequence[TokenView], columns: Sequence[str] | None = None) -> str:
    """Tab-separated values: a ``row`` column (the view's index), then the view's columns."""
    lines: list[str] = []
    for i, view in enumerate(views):
        names = _columns(view, columns)
        lines.append("\t".join(["row", *names]))
        for k in range(len(view.tokens)):
            cells = [format_cell(n, view.value(n, k)) for n in names]
            lines.append("\t".join([str(i), *cells]))
    return "\n".join(lines) + "\n"
