"""``creditrl serve-tinker``: a local Tinker service for the unmodified ``tinker`` SDK.

Point the SDK at it and run a recipe as usual (the SDK wants a key starting with ``tml-``):

    creditrl serve-tinker --out tinker_out &
    TINKER_BASE_URL=http://127.0.0.1:8001 TINKER_API_KEY=tml-local python my_recipe.py

Base models: the embedded SmolLM2-135M-Instruct (as ``HuggingFaceTB/SmolLM2-135M-Instruct``,
``SmolLM2-135M-Instruct`` or ``embedded``), ``--model NAME=DIR`` models, and any local model
directory by its absolute path. Every training model writes ``OUT/runs/<model id>/`` for
``creditrl report`` and ``creditrl explain``; checkpoints go to ``OUT/checkpoints``. See
docs/tinker.md for what is supported.
"""

from __future__ import annotations

import argparse
import secrets
import threading
from pathlib import Path
from typing import Any

from rich.console import Console

from creditrl.errors import UserError
from creditrl.hosts import is_loopback
from creditrl.plain_text import as_text


def _models(items: list[str]) -> dict[str, str]:
    models = {}
    for item in items:
        name, sep, directory = item.partition("=")
        if not sep or not name or not directory:
            raise UserError(f"--model {item!r}: expected NAME=DIR")
        models[name] = directory
    return models


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl serve-tinker``: serve until interrupted."""
    from creditrl.tinker.server import TinkerServer
    from creditrl.tinker.service import Settings

    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    for flag, value in (("--max-sessions", args.max_sessions), ("--max-models", args.max_models)):
        if value < 1:
            raise UserError(f"{flag} {value}: must be at least 1")
    api_key = args.api_key
    if api_key is None and not is_loopback(args.host):
        api_key = f"tml-{secrets.token_urlsafe(24)}"
    settings = Settings(
        out_dir=Path(args.out),
        models=_models(args.model),
        max_sessions=args.max_sessions,
        max_models=args.max_models,
    )
    server = TinkerServer(settings, args.host, args.port, api_key)
    try:
        server.start()
    except OSError as err:
        raise UserError(f"cannot serve on {args.host}:{args.port}: {err.strerror or err}") from None
    key = api_key or "tml-local (any key starting with tml-)"
    console.print(as_text(f"Tinker service on {server.base_url}, writing {settings.out_dir}"))
    console.print(as_text(f"  export TINKER_BASE_URL={server.base_url} TINKER_API_KEY={key}"))
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()
    return 0


def register(sub: Any) -> None:
    """Add ``serve-tinker`` to the CLI."""
    cmd = sub.add_parser(
        "serve-tinker",
        help="a local Tinker service: run tinker-cookbook recipes on this machine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    cmd.add_argument("--port", type=int, default=8001, help="port (0: any free one)")
    cmd.add_argument("--out", default="tinker_out", help="run folders and checkpoints")
    cmd.add_argument(
        "--model",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help="serve the local model directory DIR as base model NAME (repeatable)",
    )
    cmd.add_argument(
        "--api-key",
        help="require this key (X-API-Key); default: none on loopback, a printed random one "
        "elsewhere",
    )
    cmd.add_argument(
        "--threads",
        type=int,
        help="torch threads (default torch's choice; 1 on a machine shared with other jobs)",
    )
    cmd.add_argument("--max-sessions", type=int, default=8, help="sessions held at once")
    cmd.add_argument("--max-models", type=int, default=4, help="models loaded at once")
    cmd.set_defaults(handler=run)
