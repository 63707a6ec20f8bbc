"""``TokenView``: one response, token by token, with every quantity known for it; and the
display text of byte-level BPE tokens."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from creditrl.inspect.columns import COLUMNS

__all__ = ["TokenView", "token_text"]

Number = float | int | None


@dataclass
class TokenView:
    """One response. ``columns[name][k]`` is column ``name`` at response position k (step
    t = k + 1); None where the quantity is not known. ``tokens[k]`` is the text of y_{k+1}.
    ``settings`` holds the knobs the numbers depend on (γ, λ, β, estimators); ``notes`` what
    the reader should know (fallbacks, consistency checks)."""

    title: str
    tokens: list[str]
    columns: dict[str, list[Number]]
    prompt: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        self.columns.setdefault("t", list(range(1, n + 1)))
        for name, values in self.columns.items():
            if len(values) != n:
                raise ValueError(
                    f"{self.title}: column {name!r} has {len(values)} values for {n} tokens"
                )

    def present(self) -> list[str]:
        """Column names with at least one known value, in catalogue order (``token`` included;
        uncatalogued columns last)."""
        known = {
            name
            for name, values in self.columns.items()
            if any(v is not None and not (isinstance(v, float) and math.isnan(v)) for v in values)
        }
        known.add("token")
        ordered = [name for name in COLUMNS if name in known]
        return ordered + sorted(known - set(COLUMNS))

    def value(self, name: str, k: int) -> Any:
        """Column ``name`` at position k (``token`` gives the text); None when unknown."""
        if name == "token":
            return self.tokens[k]
        values = self.columns.get(name)
        if values is None:
            return None
        v = values[k]
        return None if isinstance(v, float) and math.isnan(v) else v

    def as_dict(self) -> dict[str, Any]:
        """JSON-able form (NaN as None)."""
        return {
            "title": self.title,
            "prompt": self.prompt,
            "tokens": self.tokens,
            "columns": {
                name: [self.value(name, k) for k in range(len(self.tokens))]
                for name in self.columns
            },
            "settings": self.settings,
            "notes": self.notes,
        }


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: printable stand-in character -> byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_text(piece: str) -> str:
    """The text a tokenizer piece stands for: byte-level BPE pieces ("Ġthe", "Ċ") are mapped
    back to bytes and decoded as UTF-8 (a piece holding part of a multi-byte character shows
    its bytes as ``\\xNN``); SentencePiece's "▁" becomes a space; anything else is returned
    as is."""
    decoder = _byte_decoder()
    if piece and all(ch in decoder for ch in piece):
        return bytes(decoder[ch] for ch in piece).decode("utf-8", errors="backslashreplace")
    return piece.replace("▁", " ")
