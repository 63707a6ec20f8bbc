"""Tool output as the policy will see it: truncated to a character budget on a chosen side."""

from __future__ import annotations

__all__ = ["TRUNCATE_SIDES", "truncate_text"]

TRUNCATE_SIDES = ("left", "right", "middle")


def truncate_text(text: str, max_chars: int, side: str = "middle") -> str:
    """``text`` cut to at most ``max_chars`` kept characters, with a marker where it was cut.

    ``side`` names the part that is removed: ``right`` keeps the first ``max_chars``
    characters, ``left`` the last ``max_chars``, ``middle`` the first ``ceil(max_chars / 2)``
    and the last ``floor(max_chars / 2)``. The marker ``...[N chars truncated]...`` is added
    at the cut. ``max_chars <= 0`` keeps the text whole.
    """
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side must be one of {TRUNCATE_SIDES}, got {side!r}")
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    marker = f"...[{len(text) - max_chars} chars truncated]..."
    if side == "right":
        return text[:max_chars] + marker
    if side == "left":
        return marker + text[len(text) - max_chars :]
    head = (max_chars + 1) // 2
    tail = max_chars - head
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")
