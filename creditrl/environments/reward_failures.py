"""A verifiers rubric's reward functions that fail, seen from the functions themselves.

verifiers scores a reward function that raises (or returns something that is not a number) 0
and only logs it. Logs are the user's to configure (``vf.setup_logging`` clears the
``verifiers`` logger's handlers, ``VF_LOG_LEVEL=CRITICAL`` silences it), so creditrl does not
read them: ``watch_rubric`` wraps each reward function of a rubric (and of its sub-rubrics)
once, keeping its name and signature (verifiers passes each function the arguments it names),
and a failure is recorded, then raised on as before. ``with reward_failures() as failures:``
around an episode's scoring collects its failures (a context variable: each episode task has
its own list).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from creditrl.usercode import one_line

__all__ = ["reward_failures", "watch_rubric"]

_failures: ContextVar[list[str] | None] = ContextVar("creditrl_reward_failures", default=None)
_WATCHED = "__creditrl_watched__"


@contextmanager
def reward_failures() -> Iterator[list[str]]:
    """The failures of the reward functions called inside the block (in this context)."""
    failures: list[str] = []
    token = _failures.set(failures)
    try:
        yield failures
    finally:
        _failures.reset(token)


def _record(name: str, why: str) -> None:
    sink = _failures.get()
    if sink is not None:
        sink.append(one_line(f"reward function {name} {why}", 300))


def _checked(name: str, value: Any) -> Any:
    try:
        float(value)
    except Exception:
        _record(name, f"returned a {type(value).__name__}, not a number")
    return value


def _watched(func: Callable[..., Any]) -> Callable[..., Any]:
    if getattr(func, _WATCHED, False):
        return func
    name = getattr(func, "__name__", type(func).__name__)

    def failed(e: Exception) -> None:
        _record(name, f"raised {type(e).__name__}: {e}")

    if inspect.iscoroutinefunction(func):

        @functools.wraps(func)
        async def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                value = await func(*args, **kwargs)
            except Exception as e:
                failed(e)
                raise
            return _checked(name, value)

    else:

        @functools.wraps(func)
        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                value = func(*args, **kwargs)
            except Exception as e:
                failed(e)
                raise
            return value if inspect.isawaitable(value) else _checked(name, value)

    setattr(watched, _WATCHED, True)
    return watched


def watch_rubric(rubric: Any) -> None:
    """Wrap the reward functions of ``rubric`` and of the rubrics it groups (``rubrics``)."""
    stack, seen = [rubric], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        funcs = getattr(current, "funcs", None)
        if isinstance(funcs, list):
            funcs[:] = [_watched(f) if callable(f) else f for f in funcs]
        stack.extend(getattr(current, "rubrics", None) or ())
