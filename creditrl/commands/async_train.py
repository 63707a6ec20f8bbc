"""``creditrl async``: a learner and ``asynchronous.num_samplers`` samplers on this machine."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from creditrl.errors import UserError
from creditrl.plain_text import as_text


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl async [CONFIG] [key=value ...]`` and ``--make-keys DIR``."""
    if args.make_keys:
        from creditrl.asynchronous.transport import make_curve_keys

        path = make_curve_keys(args.make_keys)
        console.print(as_text(f"CURVE keys in {path}; set asynchronous.curve_keys_dir={path}"))
        return 0
    from creditrl.asynchronous.launcher import launch, load_from_args
    from creditrl.asynchronous.settings import check_async_config
    from creditrl.preflight import preflight

    warnings: list[str] = []
    notes: list[str] = []  # settings the async defaults decided, then preflight's
    try:
        cfg, config_file, overrides = load_from_args(args.args, warnings, notes)
        check_async_config(cfg)
        notes += preflight(cfg)  # user code, data files and scorers, before any process starts
    except (UserError, ValueError) as err:
        console.print("[red]error:[/red]", as_text(err), soft_wrap=True)
        return 2
    for line in warnings:
        console.print("[yellow]warning:[/yellow]", as_text(line))
    for line in notes:
        console.print("[yellow]note:[/yellow]", as_text(line))
    try:
        return launch(cfg, config_file, overrides, console)
    except UserError as err:  # the output folder is in use, or is no folder
        console.print("[red]error:[/red]", as_text(err), soft_wrap=True)
        return 2


def register(sub: Any) -> None:
    """Add ``async`` to the CLI."""
    cmd = sub.add_parser("async", help="train asynchronously: local learner + samplers (spec 003)")
    cmd.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    cmd.add_argument("--make-keys", metavar="DIR", help="create CURVE keys in DIR and exit")
    cmd.set_defaults(handler=run)
