"""One render of a chat template, bounded in time, on any thread.

A model's chat template is checked once when its tokenizer loads, on sample conversations
(``creditrl.models.chat_template``); a template whose work explodes only on particular content
passes that check and would then hang the run, or the thread serving a request, on the content
that triggers it. ``time_bound`` interrupts the work inside it after ``seconds`` with
``RenderTimeout``, raised in the thread that runs the block whichever thread that is (the main
thread, a data loader, the agent endpoint's or the Tinker service's workers): one watchdog
thread holds every deadline and, when one passes, asks the interpreter to raise the exception
in that thread (``PyThreadState_SetAsyncExc``), which it does between two Python instructions
of the render (Jinja's loops are Python). No signal is used, so the bound holds off the main
thread and whatever the process does with its interval timer. Work inside one C call (a regular
expression, a tokenizer's Rust code) is interrupted only when it returns to Python.
"""

from __future__ import annotations

import ctypes
import heapq
import itertools
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["RENDER_TIME_S", "RenderTimeout", "time_bound"]

RENDER_TIME_S = 5.0  # one render of a request or a turn: the template's load-time check's budget


class RenderTimeout(Exception):
    """The work inside ``time_bound`` ran past its seconds."""


def _raise_in(ident: int, exc: type[BaseException] | None) -> None:
    """Have thread ``ident`` raise ``exc`` at its next Python instruction (None: forget one not
    raised yet)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc)
    )


class _Bound:
    """One block under ``time_bound``: its thread and deadline; ``fired`` once the exception
    was asked for, ``done`` once the block has ended (then it is never asked for)."""

    def __init__(self, seconds: float) -> None:
        self.ident = threading.get_ident()
        self.deadline = time.monotonic() + seconds
        self.lock = threading.Lock()
        self.fired = self.done = False

    def fire(self) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                _raise_in(self.ident, RenderTimeout)

    def finish(self) -> None:
        with self.lock:
            self.done = True
            if self.fired:  # asked for but maybe not raised yet: never outside the block
                _raise_in(self.ident, None)


class _Watchdog:
    """One daemon thread that fires each bound whose deadline has passed."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.heap: list[tuple[float, int, _Bound]] = []
        self.order = itertools.count()
        self.thread: threading.Thread | None = None

    def watch(self, bound: _Bound) -> None:
        with self.cond:
            heapq.heappush(self.heap, (bound.deadline, next(self.order), bound))
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(
                    target=self._run, name="creditrl-render-bound", daemon=True
                )
                self.thread.start()
            if self.heap[0][2] is bound:  # the earliest deadline: wake the watchdog
                self.cond.notify()

    def _run(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                while self.heap and (self.heap[0][2].done or self.heap[0][0] <= now):
                    _, _, bound = heapq.heappop(self.heap)
                    if not bound.done:
                        bound.fire()
                self.cond.wait(self.heap[0][0] - now if self.heap else None)


_WATCHDOG = _Watchdog()


def _after_fork() -> None:  # the child has no watchdog thread, and maybe a held lock
    global _WATCHDOG
    _WATCHDOG = _Watchdog()


os.register_at_fork(after_in_child=_after_fork)


@contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Raise ``RenderTimeout`` in the block, on whichever thread runs it, once it has run
    ``seconds``; nothing is raised after the block has ended."""
    bound = _Bound(seconds)
    _WATCHDOG.watch(bound)
    try:
        try:
            yield
        finally:
            bound.finish()
    except RenderTimeout as err:
        if err.args:
            raise
        raise RenderTimeout(f"did not render within {seconds:g} s") from None
