"""``creditrl sampler``: one sampling worker of an asynchronous run (spec 003)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from creditrl.errors import UserError
from creditrl.plain_text import as_text


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl sampler [CONFIG] [key=value ...] --index I``; exit code 1 when the
    learner disconnects this sampler, 2 for a config or data error."""
    from creditrl.asynchronous.launcher import load_from_args
    from creditrl.asynchronous.sampler import Sampler

    try:
        cfg, _, _ = load_from_args(args.args)
        sampler = Sampler(cfg, args.index, console=console)
    except UserError as err:
        console.print(f"[red]sampler {args.index}:[/red]", as_text(err))
        return 2
    return sampler.run()


def register(sub: Any) -> None:
    """Add ``sampler`` to the CLI."""
    cmd = sub.add_parser("sampler", help="an async sampling worker (connects to the learner)")
    cmd.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    cmd.add_argument("--index", type=int, default=0, help="sampler number (id s<index>)")
    cmd.set_defaults(handler=run)
