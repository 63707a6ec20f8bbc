"""What the CLI and the Python API print for a person: one red line per error, one yellow
line per warning, and log records as plain text (a warning may quote model output)."""

from __future__ import annotations

import logging

from rich.console import Console

from creditrl.plain_text import as_text, plain

__all__ = ["PlainLogFormatter", "log_plainly", "print_error", "print_warning"]


def print_error(console: Console, err: Exception) -> None:
    """``err`` as one red line "error: ..." (a UserError's message is the whole story)."""
    text = " ".join(str(err).splitlines())
    console.print("[red]error:[/red]", as_text(text), soft_wrap=True)


def print_warning(console: Console, text: str) -> None:
    """One yellow line "warning: ..."."""
    console.print(as_text(f"warning: {text}", style="yellow"), soft_wrap=True)


class PlainLogFormatter(logging.Formatter):
    """Log records as ``plain`` text: a warning may quote model output, a data row or a path."""

    def format(self, record: logging.LogRecord) -> str:
        return plain(super().format(record))


def log_plainly() -> None:
    """Warnings and errors to stderr as ``plain`` text, as Python prints them when logging is
    not configured; nothing when it is (an application's handlers are left alone)."""
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        handler.setFormatter(PlainLogFormatter())
        root.addHandler(handler)
