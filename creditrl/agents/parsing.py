"""Tool calls and answers in generated text (text is for parsing only; ids are never rebuilt).

Tool calls use the Hermes / Qwen format::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>

``arguments`` may also be a JSON string holding the object (OpenAI's wire format) or be
omitted (no arguments). Each call object gives one ``ParsedCall`` (a block may hold a JSON list
of them, SmolLM2's format); a block that is not valid JSON, not an object with a string
``name``, or never closed gives a call with ``error`` set (the loop turns it into an error
observation). A block is decoded only within ``CALL_LIMITS`` (bytes, nesting depth, elements):
model-written JSON nested thousands deep would otherwise end the run in a RecursionError.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from creditrl.bounded_json import JsonLimitError, JsonLimits, loads_bounded
from creditrl.rewards.scorers import extract_answer, tag_blocks

__all__ = [
    "CALL_LIMITS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "ParsedCall",
    "extract_answer",
    "parse_tool_calls",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# One <tool_call> block's JSON, and an arguments string inside it.
CALL_LIMITS = JsonLimits(max_bytes=1 << 16, max_depth=16, max_items=10_000)


@dataclass
class ParsedCall:
    """One ``<tool_call>`` block: ``name`` and ``arguments``, or ``error`` when malformed."""

    name: str | None
    arguments: Any
    raw: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def _parse_block(raw: str) -> ParsedCall:
    body = raw.strip()
    try:
        obj = loads_bounded(body, CALL_LIMITS)
    except json.JSONDecodeError as e:
        return ParsedCall(None, None, raw, f"invalid JSON in <tool_call>: {e.msg} at char {e.pos}")
    except JsonLimitError as e:
        return ParsedCall(None, None, raw, f"<tool_call> JSON {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ParsedCall(
            None, None, raw, 'a tool call must be {"name": <string>, "arguments": {...}}'
        )
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = loads_bounded(arguments, CALL_LIMITS) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ParsedCall(obj["name"], None, raw, f"arguments string is not JSON: {e.msg}")
        except JsonLimitError as e:
            return ParsedCall(obj["name"], None, raw, f"arguments string JSON {e}")
    if arguments is None:
        arguments = {}
    return ParsedCall(obj["name"], arguments, raw)


def _parse_blocks(raw: str) -> list[ParsedCall]:
    """One block: a call object, or a JSON list of call objects (several calls)."""
    try:
        obj = loads_bounded(raw.strip(), CALL_LIMITS)
    except ValueError:
        return [_parse_block(raw)]
    if isinstance(obj, list) and obj:
        return [_parse_block(json.dumps(item)) for item in obj]
    return [_parse_block(raw)]


def parse_tool_calls(text: str) -> list[ParsedCall]:
    """Every ``<tool_call>...</tool_call>`` block of ``text`` in order (a block holding a JSON
    list gives one call per element), plus one malformed call for a final ``<tool_call>`` that
    is never closed."""
    blocks = tag_blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
    calls = [call for raw in blocks for call in _parse_blocks(raw)]
    last_close = text.rfind(TOOL_CALL_CLOSE)
    tail = text[last_close + len(TOOL_CALL_CLOSE) :] if last_close >= 0 else text
    if TOOL_CALL_OPEN in tail:
        raw = tail[tail.index(TOOL_CALL_OPEN) + len(TOOL_CALL_OPEN) :]
        calls.append(ParsedCall(None, None, raw, "<tool_call> is never closed by </tool_call>"))
    return calls
