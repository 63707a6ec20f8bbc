"""``creditrl async``: a learner and ``asynchronous.num_samplers`` samplers on this machine."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from creditrl.config.loader import ConfigError


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl async [CONFIG] [key=value ...]`` and ``--make-keys DIR``."""
    if args.make_keys:
        from creditrl.asynchronous.transport import make_curve_keys

        path = make_curve_keys(args.make_keys)
        console.print(f"CURVE keys in {path}; set asynchronous.curve_keys_dir={path}")
        return 0
    from creditrl.asynchronous.launcher import launch, load_from_args
    from creditrl.asynchronous.settings import check_async_config

    try:
        cfg, config_file, overrides = load_from_args(args.args)
        check_async_config(cfg)
    except (ConfigError, ValueError) as err:
        console.print(f"[red]config error:[/red] {err}")
        return 2
    return launch(cfg, config_file, overrides, console)


def register(sub: Any) -> None:
    """Add ``async`` to the CLI."""
    cmd = sub.add_parser("async", help="train asynchronously: local learner + samplers (spec 003)")
    cmd.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    cmd.add_argument("--make-keys", metavar="DIR", help="create CURVE keys in DIR and exit")
    cmd.set_defaults(handler=run)
