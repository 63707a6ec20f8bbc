"""JSON from outside (model-written tool calls, peer messages, data rows, scorer results),
decoded only after its size is known to be bounded.

``json.loads`` recurses once per nesting level (a few thousand ``[`` end in a RecursionError
that takes the caller down) and builds one Python object per element (``[[],[],...]`` holds
~60 bytes of memory per 3 bytes of text). So before decoding, ``loads_bounded`` checks the
text's bytes, then its nesting depth and element count, read from its skeleton: the text with
every string literal cut out by one regular expression, then bracket and comma counts over a
numpy view of the bytes. Every step runs in C, in time linear in the bytes, and holds at most
a few bytes per input byte. A text over a limit raises ``JsonLimitError`` (a ``ValueError``)
naming the measure, its value and the limit. Bytes must be UTF-8 (what ``json.dumps``
writes), so that the scan and the parser read the same characters.

Only ``[ { , :`` open a value or a key outside strings and only ``[ { ] }`` nest, so the scan
agrees with the parser on every prefix the parser accepts: what ``json.loads`` builds is never
deeper or larger than the scan says. ``held_bytes`` bounds the memory the decoded values hold,
which the async learner charges against its buffer.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "HELD_PER_BYTE",
    "HELD_PER_ITEM",
    "RUN_RECORD_LIMITS",
    "JsonLimitError",
    "JsonLimits",
    "held_bytes",
    "json_shape",
    "loads_bounded",
    "read_json_file",
]

# A JSON string literal, unrolled so that the engine loops without backtracking; one never
# closed runs to the end (else each later quote would rescan the rest: quadratic time).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z)', re.DOTALL)
_CHUNK = 1 << 16
# Python memory of decoded JSON, at most: 4 bytes per byte of text (a str holding one character
# beyond U+FFFF stores every character in 4 bytes) plus 128 per element (the worst shapes
# measured with tracemalloc hold about 66 per element: a list of one-key dicts)
HELD_PER_BYTE = 4
HELD_PER_ITEM = 128


class JsonLimitError(ValueError):
    """A JSON text over one of its limits (bytes, depth, elements)."""


@dataclass(frozen=True)
class JsonLimits:
    """How large a JSON text may be: bytes of UTF-8, nesting depth (a bare value is 0, ``[1]``
    is 1) and elements (containers plus their members, an upper bound counted on the text)."""

    max_bytes: int
    max_depth: int = 32
    max_items: int = 100_000

    def check(self, data: bytes | memoryview) -> int:
        """The elements of ``data`` if it is within these limits (its length is checked before
        it is scanned); ``JsonLimitError`` naming the limit otherwise."""
        if len(data) > self.max_bytes:
            raise JsonLimitError(f"{len(data)} bytes, above the limit of {self.max_bytes}")
        depth, items = json_shape(data)
        if depth > self.max_depth:
            raise JsonLimitError(f"nested {depth} deep, above the limit of {self.max_depth}")
        if items > self.max_items:
            raise JsonLimitError(f"{items} elements, above the limit of {self.max_items}")
        return items

    def held_bound(self) -> int:
        """The most memory the decoded values of a text within these limits hold."""
        return held_bytes(self.max_bytes, self.max_items)


def held_bytes(nbytes: int, items: int) -> int:
    """The memory charged for decoded JSON of ``nbytes`` bytes and ``items`` elements."""
    return HELD_PER_BYTE * nbytes + HELD_PER_ITEM * items


# One line of a run's own JSONL files (metrics.jsonl, rollouts/step_*.jsonl), read back by
# report, explain and resume: a dumped row of a 32k-token response holds ~0.5M values.
RUN_RECORD_LIMITS = JsonLimits(max_bytes=1 << 26, max_depth=64, max_items=1 << 22)


def json_shape(data: bytes | memoryview) -> tuple[int, int]:
    """(depth, elements) of the JSON text ``data``, without decoding it. Depth is the deepest
    running count of opening minus closing brackets outside strings; elements counts the
    containers and the commas and colons between members, plus one (an upper bound of the
    values the decoder would build). Counted in chunks of ``_CHUNK`` bytes, so the work
    arrays stay small whatever the size of ``data``."""
    skeleton = np.frombuffer(_STRING.sub(b'""', data), dtype=np.uint8)
    depth = deepest = 0
    items = 1
    for start in range(0, len(skeleton), _CHUNK):
        chunk = skeleton[start : start + _CHUNK]
        opens = (chunk == ord("[")) | (chunk == ord("{"))
        closes = (chunk == ord("]")) | (chunk == ord("}"))
        running = np.cumsum(opens.view(np.int8) - closes.view(np.int8), dtype=np.int64)
        deepest = max(deepest, depth + int(running.max()))
        depth += int(running[-1])
        items += int(np.count_nonzero(opens))
        items += int(np.count_nonzero((chunk == ord(",")) | (chunk == ord(":"))))
    return deepest, items


def loads_bounded(data: str | bytes, limits: JsonLimits, allow_nan: bool = True) -> Any:
    """``json.loads(data)`` once ``data`` is within ``limits``; else ``JsonLimitError``. With
    ``allow_nan=False``, NaN and Infinity are refused too. Invalid JSON raises what
    ``json.loads`` raises (a ``ValueError``, as ``JsonLimitError`` is)."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    limits.check(raw)
    text = data if isinstance(data, str) else raw.decode("utf-8")  # not UTF-16 or -32
    return json.loads(text, parse_constant=None if allow_nan else _refuse_constant)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json_file(path: str | os.PathLike[str], limits: JsonLimits = RUN_RECORD_LIMITS) -> Any:
    """``loads_bounded`` of the file at ``path``, of which at most ``limits.max_bytes + 1``
    bytes are read (a longer file is a ``JsonLimitError``); OSError as ``open`` raises it."""
    with open(path, "rb") as f:
        data = f.read(limits.max_bytes + 1)
    return loads_bounded(data, limits)
