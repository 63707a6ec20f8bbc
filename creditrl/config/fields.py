"""What a config key accepts, kept on its dataclass field in ``schema.py``:
``field(default=4, metadata=meta(range=AT_LEAST_1))`` or ``meta(choices=(...))``, or for a
registry ``meta(registry="policy loss")``: the registry of that kind in the ground-floor
``creditrl.registry`` (``creditrl.catalog`` makes them all, declared by dotted path, so reading
their names imports no torch, and the config layer names no module above it). ``validate``
checks these and ``doc`` prints them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from creditrl.registry import registry

__all__ = [
    "AT_LEAST_0",
    "AT_LEAST_1",
    "COEFFICIENT",
    "FEW_SHOT",
    "FLOAT32_MAX",
    "GRAD_CLIP",
    "LOSS_DIVISOR",
    "OPTIONAL_AT_LEAST_0",
    "OPTIONAL_POSITIVE",
    "PORT",
    "POSITIVE",
    "SCORE",
    "SIGNED_COEFFICIENT",
    "UNIT",
    "USER_CODE",
    "Range",
    "choices_of",
    "choices_text",
    "format_value",
    "meta",
    "value_at",
]

USER_CODE = "path/to/file.py:name or package.module:name"


def value_at(node: Any, key: str) -> Any:
    """The value at dotted ``key`` of a config dataclass."""
    for part in key.split("."):
        node = getattr(node, part)
    return node


def format_value(value: Any) -> str:
    """A value as the user would type it in an override."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, str) else str(value)


@dataclass(frozen=True)
class Range:
    """An allowed interval; ``low_open``/``high_open`` exclude the end. ``null`` allows None."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    null: str = ""  # what None means, when None is allowed
    note: str = ""  # why, when the bound is not obvious

    def holds(self, value: float) -> bool:
        """``value`` lies in the interval."""
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def text(self) -> str:
        """The interval as the docs and errors write it, e.g. '>= 1', 'in (0, 1]'."""
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{format_value(self.low)}, {format_value(self.high)}{right}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {format_value(self.low)}"
        else:
            text = f"{'<' if self.high_open else '<='} {format_value(self.high)}"
        text = f"{text} (or null: {self.null})" if self.null else text
        return f"{text} ({self.note})" if self.note else text


AT_LEAST_0, AT_LEAST_1, POSITIVE = Range(0), Range(1), Range(0, low_open=True)
UNIT, PORT = Range(0, 1), Range(0, 65535)
GRAD_CLIP = Range(0, low_open=True, null="no clipping; 0 would freeze the weights")
OPTIONAL_AT_LEAST_0 = Range(0, null="unset")
OPTIONAL_POSITIVE = Range(0, low_open=True, null="unset")
# Every float setting becomes a float32 tensor somewhere; a coefficient also multiplies
# per-token terms (log-prob gaps up to ~1e4) that are then summed and squared in float32.
FLOAT32_MAX = 3.4028234663852886e38
_PRODUCTS = "larger ones overflow float32 rewards and losses"
COEFFICIENT = Range(0, 1e4, note=_PRODUCTS)
SIGNED_COEFFICIENT = Range(-1e4, 1e4, note=_PRODUCTS)
SCORE = Range(-1e9, 1e9, note="what a scorer may return")
FEW_SHOT = Range(0, 64, note="each example adds two messages to every prompt")
# A divisor of summed per-token losses (a token count, like rollout.max_response_length):
# 1e-40 made the float32 loss inf; past 1e7 the gradient is below what Adam's eps lets move.
LOSS_DIVISOR = Range(
    1e-3, 1e7, null="unset", note="smaller ones overflow float32 losses, larger ones vanish them"
)


def meta(
    *,
    range: Range | None = None,
    choices: tuple[str, ...] | None = None,
    registry: str | None = None,
    straight_through: bool = False,
    user_code: bool = False,
    options_for: str | None = None,
) -> dict[str, Any]:
    """Field metadata: the allowed ``range``, or ``choices``, or the names of the
    ``registry`` of that kind (``straight_through``: each also with a trailing '+', a KL
    estimator's straight-through form); ``user_code``: a
    ``file.py:name`` spec is accepted too; ``options_for``: this mapping holds the ``Option``s
    declared by the entry that key selects (``creditrl.config.options``)."""
    given = {
        "range": range,
        "choices": choices,
        "registry": registry,
        "options_for": options_for,
    }
    out: dict[str, Any] = {key: value for key, value in given.items() if value is not None}
    if straight_through:
        out["straight_through"] = True
    return {**out, "user_code": True} if user_code else out


def choices_of(metadata: Mapping[str, Any]) -> tuple[str, ...] | None:
    """The names a field accepts now (a registry's as registered so far); None: any."""
    if "choices" in metadata:
        return tuple(metadata["choices"])
    kind = metadata.get("registry")
    if kind is None:
        return None
    names = tuple(registry(kind).names())
    return names + tuple(f"{n}+" for n in names) if metadata.get("straight_through") else names


def choices_text(metadata: Mapping[str, Any], choices: tuple[str, ...]) -> str:
    """``choices`` listed (names that all come with and without '+' once, so noted), with the
    user-code spec when the field takes one."""
    bases = [name for name in choices if not name.endswith("+")]
    text = ", ".join(choices)
    if bases and len(bases) * 2 == len(choices):
        text = ", ".join(bases) + " (each also with a trailing '+')"
    return f"{text}, or user code as {USER_CODE}" if metadata.get("user_code") else text
