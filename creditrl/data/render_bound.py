"""One render of a chat template, bounded in time.

A model's chat template is checked once when its tokenizer loads, on sample conversations
(``creditrl.models.chat_template``); a template whose work explodes only on particular content
passes that check and would then hang the run on the row that triggers it. ``time_bound``
interrupts the work inside it after ``seconds`` with ``RenderTimeout``: a timer signal
(``SIGALRM``) whose handler raises between two Python instructions of the render (Jinja's
loops are Python). Signals reach the main thread only, so off it, on platforms without
``setitimer``, or while the process's own interval timer is armed, the render is not bounded.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["RenderTimeout", "time_bound"]


class RenderTimeout(Exception):
    """The work inside ``time_bound`` ran past its seconds."""


@contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Raise RenderTimeout in the block once it has run ``seconds`` (main thread only)."""
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    if not usable or signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return

    def expired(signum: int, frame: Any) -> None:
        raise RenderTimeout(f"did not render within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
