"""What creditrl's two HTTP servers (the agents' endpoint, the Tinker service) share: the
bounds of a request head and of the accept queue, and an aiohttp runner built with them.

A runner from ``bounded_runner`` logs no access lines, cancels a handler whose client went
away, closes a connection idle ``idle_timeout_s`` (keep-alive), lingers 1 s on a closing one,
refuses a request line or header field over ``MAX_HEAD_BYTES`` and gives handlers 5 s to end
at shutdown. Each server binds its own listening socket with ``BACKLOG`` and its own
connection limits (their modules' docstrings)."""

from __future__ import annotations

from aiohttp import web

__all__ = ["BACKLOG", "MAX_HEAD_BYTES", "bounded_runner"]

MAX_HEAD_BYTES = 8190  # one request line or header field
BACKLOG = 64  # connections waiting to be accepted (and accepted at once before a limit applies)


def bounded_runner(app: web.Application, idle_timeout_s: float) -> web.AppRunner:
    """An ``AppRunner`` for ``app`` with the bounds above (not yet set up)."""
    return web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=idle_timeout_s,
        lingering_time=1.0,
        max_line_size=MAX_HEAD_BYTES,
        max_field_size=MAX_HEAD_BYTES,
        shutdown_timeout=5.0,
    )
