"""``creditrl learner``: the training worker of an asynchronous run (spec 003)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from rich.console import Console

from creditrl.errors import UserError
from creditrl.plain_text import as_text


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl learner [CONFIG] [key=value ...] --rank R``."""
    from creditrl.asynchronous.launcher import load_from_args
    from creditrl.asynchronous.learner import Learner
    from creditrl.controller.distributed import destroy_process_group, init_process_group
    from creditrl.workers.placement import placement_for

    notes: list[str] = []
    try:
        cfg, _, _ = load_from_args(args.args, notes=notes)
        world = cfg.asynchronous.learners
        if not 0 <= args.rank < world:
            console.print(f"[red]learner:[/red] --rank {args.rank} not in [0, {world})")
            return 2
        os.environ.setdefault("LOCAL_RANK", str(args.rank))  # rank r: this machine's GPU r
        placement = placement_for(cfg)  # CUDA asked for and not here: one line
    except UserError as err:
        console.print("[red]error:[/red]", as_text(err))
        return 2
    for line in notes if args.rank == 0 else ():
        console.print("[yellow]note:[/yellow]", as_text(line))
    try:
        if world > 1:
            init_process_group(
                args.rank,
                world,
                backend=placement.backend,
                device=placement.device,
                master_port=cfg.asynchronous.dist_port,
                timeout_s=cfg.asynchronous.data_timeout_s + 60.0,
            )
        # rank 0 takes the output folder's lock (the launcher hands over its own); a folder
        # in use is one error line (creditrl.cli)
        Learner(cfg, args.rank, world, console=console).fit()
    finally:
        destroy_process_group()
    return 0


def register(sub: Any) -> None:
    """Add ``learner`` to the CLI."""
    cmd = sub.add_parser("learner", help="the async training worker (binds; samplers connect)")
    cmd.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    cmd.add_argument("--rank", type=int, default=0, help="learner rank (asynchronous.learners)")
    cmd.set_defaults(handler=run)
