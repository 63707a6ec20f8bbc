"""The ``calculator`` tool: arithmetic by a small recursive-descent parser, never ``eval``.

Grammar (Python's precedence; ``**`` binds tighter than a unary sign and is right-associative)::

    expr  := term (("+" | "-") term)*
    term  := unary (("*" | "/" | "//" | "%") unary)*
    unary := ("+" | "-") unary | power
    power := atom ("**" unary)?
    atom  := NUMBER | "(" expr ")"

Numbers are integers or decimals (``1.5``, ``.5``, ``2e3``); ``×``/``÷`` are read as ``*``/``/``.
Anything else (names, calls, ``^``) is an error naming what was found and where. Limits keep
one call cheap: at most ``MAX_CHARS`` characters, exponents up to ``MAX_EXPONENT`` in absolute
value, results below 10**``MAX_DIGITS``. (No ``ast``: CPython 3.11's parser is not safe to call
from several threads at once, and tools run in threads.)
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from typing import Any

from creditrl.tools.base import Tool, register_tool

__all__ = ["MAX_CHARS", "MAX_DIGITS", "MAX_EXPONENT", "calculate", "calculator_tool"]

MAX_CHARS = 200
MAX_EXPONENT = 100
MAX_DIGITS = 100

_TOKEN = re.compile(
    r"\s*(?:(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)|(\*\*|//|[-+*/%()]))"
)
_BINARY: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "/": operator.truediv,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
}


def _tokens(text: str) -> list[tuple[str, Any, int]]:
    """(kind, value, position) with kind "num" or "op", ending with ("end", None, len)."""
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            at = pos + len(text[pos:]) - len(text[pos:].lstrip())
            if text[at] == "^":
                raise ValueError("'^' is not a power here; write ** for powers")
            raise ValueError(f"unexpected {text[at]!r} at position {at}")
        number, op = match.groups()
        if number is not None:
            plain = number.isdigit()
            out.append(("num", int(number) if plain else float(number), match.start(1)))
        else:
            out.append(("op", op, match.start(2)))
        pos = match.end()
    out.append(("end", None, len(text)))
    return out


def _check_size(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ValueError("the result is a complex number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not a finite number")
    if abs(value) >= 10**MAX_DIGITS:
        raise ValueError(f"result has more than {MAX_DIGITS} digits")
    return value


class _Parser:
    def __init__(self, text: str) -> None:
        self.items = _tokens(text)
        self.i = 0

    def peek(self) -> tuple[str, Any, int]:
        return self.items[self.i]

    def take(self, *ops: str) -> str | None:
        kind, value, _ = self.peek()
        if kind == "op" and value in ops:
            self.i += 1
            return value
        return None

    def apply(self, op: str, left: Any, right: Any) -> int | float:
        if op == "**" and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if op in ("/", "//", "%") and right == 0:
            raise ZeroDivisionError("division by zero")
        return _check_size(_BINARY[op](left, right))

    def expr(self) -> int | float:
        value = self.term()
        while op := self.take("+", "-"):
            value = self.apply(op, value, self.term())
        return value

    def term(self) -> int | float:
        value = self.unary()
        while op := self.take("*", "/", "//", "%"):
            value = self.apply(op, value, self.unary())
        return value

    def unary(self) -> int | float:
        if sign := self.take("+", "-"):
            value = self.unary()
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> int | float:
        base = self.atom()
        if self.take("**"):
            return self.apply("**", base, self.unary())
        return base

    def atom(self) -> int | float:
        kind, value, pos = self.peek()
        if kind == "num":
            self.i += 1
            return value
        if self.take("("):
            inner = self.expr()
            if not self.take(")"):
                raise ValueError(f"missing ')' at position {self.peek()[2]}")
            return inner
        if kind == "end":
            raise ValueError("unexpected end of the expression")
        raise ValueError(f"unexpected {value!r} at position {pos}")


def _format(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return repr(round(value, 12))
    return str(value)


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result as text.

    Args:
        expression: arithmetic with numbers, + - * / // % ** and parentheses, e.g. "(12 + 7) * 3"
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string")
    if len(expression) > MAX_CHARS:
        raise ValueError(f"expression is longer than {MAX_CHARS} characters")
    parser = _Parser(expression.replace("×", "*").replace("÷", "/"))
    value = parser.expr()
    kind, token, pos = parser.peek()
    if kind != "end":
        raise ValueError(f"unexpected {token!r} at position {pos}")
    return _format(value)


@register_tool("calculator")
def calculator_tool() -> Tool:
    """The ``calculator`` Tool."""
    return Tool.from_function(calculate, name="calculator")
