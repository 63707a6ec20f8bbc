"""One long-lived event loop per environment, on a thread of its own.

An environment keeps asyncio objects across episodes (a judge's ``AsyncOpenAI`` client made
in ``load_environment``, whose pooled connections belong to the loop that opened them). Each
agent episode runs on an event loop of its own that ends with it (``creditrl.agents.episodes``),
so such an object used from the next episode fails ("Event loop is closed"). ``loop_of(env)``
is the one loop every episode of ``env`` runs its work on; ``await loop.run(coro)`` from an
episode's loop runs ``coro`` there, and cancelling the caller (its timeout) cancels it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

__all__ = ["LoopThread", "loop_of"]

_lock = threading.Lock()
_loops: dict[int, tuple[Any, LoopThread]] = {}


class _Escaped(Exception):
    """A SystemExit or KeyboardInterrupt of the work, carried to the caller (raised on the
    loop's own thread it would stop the loop for every later episode)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


async def _contained(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as e:
        raise _Escaped(e) from None


class LoopThread:
    """An event loop running forever on a daemon thread named ``name``."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    async def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """What ``coro`` returns or raises, run on this loop; awaited from another loop."""
        future = asyncio.run_coroutine_threadsafe(_contained(coro), self.loop)
        try:
            return await asyncio.wrap_future(future)
        except _Escaped as e:
            raise e.error from None


def loop_of(owner: Any) -> LoopThread:
    """The loop of ``owner`` (an environment), started on first use; it lives as long as the
    process, as the environments loaded in it do."""
    with _lock:
        entry = _loops.get(id(owner))
        if entry is None:
            entry = _loops[id(owner)] = (owner, LoopThread(f"creditrl-env-{len(_loops)}"))
        return entry[1]
