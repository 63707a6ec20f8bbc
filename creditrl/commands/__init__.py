"""Subcommands of ``creditrl`` beyond train/config/eval, one module each.

A module listed in ``SUBCOMMANDS`` defines ``register(sub) -> None``, which adds its parser to
the argparse sub-parsers and sets ``handler=fn(args, console) -> int`` as a default. Modules are
imported only when the CLI starts, so a heavy dependency stays out of ``import creditrl``.
"""

from __future__ import annotations

SUBCOMMANDS: list[str] = [
    "creditrl.commands.explain",
    "creditrl.commands.sampler",
    "creditrl.commands.learner",
    "creditrl.commands.async_train",
    "creditrl.commands.report",
    "creditrl.commands.check_tokenization",
    "creditrl.commands.export",
    "creditrl.commands.evaluate",
    "creditrl.commands.serve_tinker",
]
