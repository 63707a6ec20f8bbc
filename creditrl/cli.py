"""The ``creditrl`` command."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from creditrl.inspect.example import BETA, COLUMNS, GAMMA, HEADERS, LAM, spec000_example


def print_example(console: Console) -> None:
    """Print the spec 000 worked example as a per-token table with a legend."""
    data = spec000_example()
    table = Table(
        title=f"spec 000 worked example: 请问1+1=2？ -> 是的，等于2！ (beta={BETA}, "
        f"gamma={GAMMA}, lambda={LAM}, k1 KL in the reward)"
    )
    for name in COLUMNS:
        header = HEADERS.get(name, name)
        table.add_column(header, justify="left" if name == "token" else "right", no_wrap=True)
    for i in range(len(data["t"])):
        cells = []
        for name in COLUMNS:
            value = data[name][i]
            cells.append(str(value) if name in ("t", "token") else f"{float(value):+.6f}")
        table.add_row(*cells)
    console.print(table)
    for name, meaning in COLUMNS.items():
        console.print(f"  [bold]{HEADERS.get(name, name)}[/bold]: {meaning}")


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``creditrl run`` and ``creditrl explain --example``."""
    parser = argparse.ArgumentParser(prog="creditrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="the main job (until the trainer lands: the worked example)")
    explain = sub.add_parser("explain", help="per-token table of every RL quantity")
    explain.add_argument("--example", action="store_true", help="the spec 000 worked example")
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    if args.command == "run":
        console.print(
            "[yellow]The training loop is not built yet; showing the token-level core on the "
            "spec 000 worked example.[/yellow]"
        )
        print_example(console)
        return 0
    if args.command == "explain":
        if not args.example:
            parser.error("explain: only --example is available so far")
        print_example(console)
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
