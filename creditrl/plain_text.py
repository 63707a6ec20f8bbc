"""Untrusted text (model output, prompts, ground truths, tool output, data_source names, paths)
as plain displayable text: never read as rich markup, never sent to a terminal as a control
sequence, never an unencodable lone surrogate.

``plain`` is the one rule; the others wrap it for a rich console, a rich markup string and
HTML.
"""

from __future__ import annotations

import html
import re

from rich.markup import escape
from rich.text import Text

__all__ = ["as_html", "as_markup", "as_text", "plain"]

# C0 controls (ESC, BEL, backspace, carriage return, ...), DEL and C1 controls (CSI, OSC as
# single bytes), the bidi marks, embeddings, overrides and isolates, the line and paragraph
# separators, and surrogates (alone they cannot be encoded as UTF-8)
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2028\u2029\u2066-\u2069\ud800-\udfff]"
)


def _visible(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape").decode("ascii")


def plain(value: object, keep: str = "\n\t") -> str:
    """``str(value)`` with every control, bidi-control or surrogate character shown as its
    Python escape (``\\x1b``, ``\\u202e``, ``\\ud800``) instead of acting; the characters
    in ``keep`` (newline and tab by default) stay as they are."""
    return _UNSAFE.sub(lambda m: m.group() if m.group() in keep else _visible(m), str(value))


def as_text(value: object, style: str = "", keep: str = "\n\t") -> Text:
    """``plain(value)`` as a rich ``Text``: printed literally (no markup, emoji codes or
    highlighting)."""
    return Text(plain(value, keep), style=style)


def as_markup(value: object, keep: str = "\n\t") -> str:
    """``plain(value)`` for inside a rich markup string: every ``[`` that could open a tag is
    escaped."""
    return escape(plain(value, keep))


def as_html(value: object, keep: str = "\n\t") -> str:
    """``plain(value)`` for HTML text or a quoted attribute value."""
    return html.escape(plain(value, keep))
