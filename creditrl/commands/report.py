"""``creditrl report RUN_DIR``: plots of a run's metrics.jsonl as an HTML page and PNGs.

Works on a run that is still going; ``--watch N`` rewrites the report every N seconds (the page
reloads itself) until interrupted.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from rich.console import Console

from creditrl.plain_text import as_text


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl report``."""
    from creditrl.report.page import write_report

    try:
        while True:
            files = write_report(args.run_dir, args.out, not args.no_png, args.watch)
            pngs = f" and {len(files.pngs)} PNGs" if files.pngs else ""
            console.print(as_text(f"wrote {files.html}{pngs}"))
            for note in files.notes:
                console.print("[yellow]note:[/yellow]", as_text(note))
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except FileNotFoundError as err:
        console.print("[red]report:[/red]", as_text(err))
        return 2
    except KeyboardInterrupt:
        return 0


def register(sub: Any) -> None:
    """Add ``report`` to the CLI."""
    cmd = sub.add_parser(
        "report",
        help="HTML report (and PNGs) of a run's metrics",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("run_dir", help="the run's output_dir (holds metrics.jsonl)")
    cmd.add_argument("--out", help="output folder (default: RUN_DIR/report)")
    cmd.add_argument("--no-png", action="store_true", help="HTML only")
    cmd.add_argument(
        "--watch", type=float, metavar="SECONDS", help="rewrite every SECONDS until interrupted"
    )
    cmd.set_defaults(handler=run)
