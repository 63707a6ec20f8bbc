"""Bounds on what a scorer returns: checked before a result is used, sent or parsed.

A scorer's result is untrusted input. The scoring side (``worker.score_request``, in a worker
process or in this one) bounds its depth, value count and bytes and range-checks its numbers;
the parent bounds a worker's reply line before ``json.loads`` and checks it again field by
field (``parse_line``, ``check_reply``). A result outside a bound is a failed sample with the
reason: status "error" for shape and size, "nan" for numbers, as for a NaN score.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Mapping
from typing import Any

from creditrl.usercode import one_line

__all__ = [
    "FLOAT32_MAX",
    "MAX_DEPTH",
    "MAX_ERROR_CHARS",
    "MAX_EXTRA_BYTES",
    "MAX_LINE_CHARS",
    "MAX_SCORE",
    "MAX_VALUES",
    "check_numbers",
    "check_reply",
    "check_shape",
    "encode_extra",
    "failure",
    "parse_line",
]

MAX_SCORE = 1e9  # the async learner's limit too: larger scores overflow float32 group statistics
FLOAT32_MAX = (2 - 2**-23) * 2.0**127  # the largest finite float32
MAX_DEPTH = 32  # containers nested in a result's extras
MAX_VALUES = 10_000  # entries of all containers in a result's extras, together
MAX_EXTRA_BYTES = 256 * 1024  # a result's extras as JSON (ASCII)
MAX_ERROR_CHARS = 1_000  # an error message; as JSON at most 12 bytes a character
# a reply line: the extras, the error message and the few other fields
MAX_LINE_CHARS = MAX_EXTRA_BYTES + 16 * 1024
STATUSES = ("ok", "error", "nan")  # what a scorer's reply may say ("timeout" is the parent's)


def failure(status: str, message: str) -> dict[str, Any]:
    """The reply of a sample that failed to score, its message cut to ``MAX_ERROR_CHARS``."""
    error = one_line(message, MAX_ERROR_CHARS)
    return {"status": status, "score": None, "extra": {}, "error": error}


def check_shape(extra: Any) -> str | None:
    """Why ``extra`` is too deep or too large to keep, or None.

    Iterative, and it stops at the first excess, so a deep or huge value costs little: lists,
    tuples, sets and mappings count their entries (at most ``MAX_VALUES`` in all) and nest at
    most ``MAX_DEPTH`` deep; strings, bytes and string keys hold at most ``MAX_EXTRA_BYTES``
    characters in all.
    """
    stack: list[tuple[Any, int]] = [(extra, 1)]
    values = chars = 0
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str | bytes):
            chars += len(item)
        elif isinstance(item, Mapping | list | tuple | set | frozenset):
            if depth > MAX_DEPTH:
                return f"nested deeper than {MAX_DEPTH} levels"
            values += len(item)
            if values > MAX_VALUES:
                return f"more than {MAX_VALUES} values"
            if isinstance(item, Mapping):
                chars += sum(len(k) for k in item if isinstance(k, str))
                item = item.values()
            stack.extend((child, depth + 1) for child in item)
        if chars > MAX_EXTRA_BYTES:
            return f"more than {MAX_EXTRA_BYTES} bytes of text"
    return None


def encode_extra(extra: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``(json, None)`` for extras within ``check_shape``'s bounds and ``MAX_EXTRA_BYTES`` as
    JSON (values JSON cannot hold become their ``str()``), else ``(None, why)``."""
    problem = check_shape(extra)
    if problem is not None:
        return None, problem
    try:
        encoded = json.dumps(extra, default=str)
    except (TypeError, ValueError) as e:
        return None, f"not JSON-able: {e}"
    if len(encoded) > MAX_EXTRA_BYTES:
        return None, f"more than {MAX_EXTRA_BYTES} bytes as JSON"
    return encoded, None


def _as_float(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int beyond the float range
        return math.inf if value > 0 else -math.inf


def check_numbers(score: float, extra: Mapping[str, Any]) -> str | None:
    """Why a result's numbers cannot be used, or None: the score must be finite and within
    +-``MAX_SCORE``; each number directly in ``extra`` (a sub-metric) a finite float32."""
    if not math.isfinite(score):
        return f"scorer returned a non-finite score {score!r}"
    if abs(score) > MAX_SCORE:
        return f"scorer returned the score {score!r}, beyond +-{MAX_SCORE:g}"
    for key, value in extra.items():
        if isinstance(value, numbers.Real):
            number = _as_float(value)
            if not (math.isfinite(number) and abs(number) <= FLOAT32_MAX):
                return f"scorer returned {one_line(key, 100)!r} = {number!r}, not a finite float32"
    return None


def parse_line(line: str) -> Any:
    """A protocol line's JSON value; ValueError with the reason for a line longer than
    ``MAX_LINE_CHARS``, one that is not JSON, or one nested too deeply for the parser."""
    if len(line) > MAX_LINE_CHARS:
        raise ValueError(f"a line longer than {MAX_LINE_CHARS} characters")
    try:
        return json.loads(line)
    except RecursionError:
        raise ValueError("a line nested too deeply to parse") from None
    except ValueError as e:
        raise ValueError(f"a line that is not JSON ({one_line(e, 200)})") from None


def check_reply(reply: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's decoded reply made safe to use: ``{"status", "score", "extra", "error"}``
    when it is well formed and within the bounds, else a ``failure`` saying why."""
    status, score, extra, error = (reply.get(k) for k in ("status", "score", "extra", "error"))
    if status not in STATUSES or not isinstance(error, str | None) or not isinstance(extra, dict):
        return failure("error", "reward worker sent a malformed reply (status, error or extra)")
    if status != "ok":
        return failure(status, error or f"status {status}")
    problem = check_shape(extra)
    if problem is not None:
        return failure("error", f"scorer result refused: {problem}")
    if isinstance(score, bool) or not isinstance(score, int | float):
        return failure(
            "error", f"reward worker's score {one_line(repr(score), 50)} is not a number"
        )
    reason = check_numbers(_as_float(score), extra)
    if reason is not None:
        return failure("nan", reason)
    return {"status": "ok", "score": float(score), "extra": extra, "error": None}
