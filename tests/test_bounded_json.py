"""bounded_json: limits checked on the text before decoding, in C-speed passes."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from creditrl.bounded_json import JsonLimitError, JsonLimits, json_shape, loads_bounded

LIMITS = JsonLimits(max_bytes=1 << 20, max_depth=8, max_items=1000)


@pytest.mark.parametrize(
    "text,depth,items",
    [
        ("1", 0, 1),
        ("[]", 1, 2),
        ('{"a": [1, 2, {"b": null}]}', 3, 8),
        ('["[[[[", "{{{", "\\"[[", ",,,"]', 1, 5),  # brackets, quotes, commas inside strings
        ('"a\\\\"', 0, 1),  # an escaped backslash closes the string
    ],
)
def test_shape_counts_structure_outside_strings(text: str, depth: int, items: int) -> None:
    assert json_shape(text.encode()) == (depth, items)
    assert len(str(json.loads(text))) >= 0  # valid JSON: the counts are of real documents


def test_values_within_limits_decode_as_json_does() -> None:
    value = {"prompt": "What is [1, 2]?", "extra": {"tags": ["a", "b"], "n": 3.5, "x": None}}
    assert loads_bounded(json.dumps(value), LIMITS) == value
    assert loads_bounded(json.dumps(value).encode(), LIMITS) == value


@pytest.mark.parametrize(
    "text,message",
    [
        ("[" * 100_000 + "]" * 100_000, "nested 100000 deep, above the limit of 8"),
        ("[" + "[]," * 5000 + "1]", "10002 elements, above the limit of 1000"),
        ('"' + "x" * (1 << 20) + '"', f"{(1 << 20) + 2} bytes, above the limit of {1 << 20}"),
    ],
)
def test_over_a_limit_is_one_error_naming_it(text: str, message: str) -> None:
    with pytest.raises(JsonLimitError, match="^" + message.replace("[", r"\[")):
        loads_bounded(text, LIMITS)


def test_invalid_json_raises_as_json_loads_does() -> None:
    for text in ('{"a": ', "\xff", b"\xff"):
        with pytest.raises(ValueError) as caught:
            loads_bounded(text, LIMITS)
        assert not isinstance(caught.value, JsonLimitError)
    assert loads_bounded("[NaN]", LIMITS) != [0.0]
    with pytest.raises(ValueError, match="NaN is not a number JSON allows"):
        loads_bounded("[NaN]", LIMITS, allow_nan=False)


def test_checking_holds_memory_linear_in_the_bytes() -> None:
    """A 4 MB text of empty lists (decoded: ~80 MB of list objects) is refused by its element
    count while the check holds a few bytes per input byte."""
    text = ("[" + "[]," * ((4 << 20) // 3) + "1]").encode()
    tracemalloc.start()
    with pytest.raises(JsonLimitError, match="elements"):
        loads_bounded(text, JsonLimits(max_bytes=1 << 24, max_items=1000))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 16 * len(text)


def test_an_unclosed_string_is_scanned_once() -> None:
    """'"' followed by escaped quotes and no closing one: each quote would start a rescan of
    the rest (quadratic) if an unclosed string did not run to the end."""
    text = b'["' + b'\\"' * 200_000
    assert json_shape(text) == (1, 2)
    with pytest.raises(json.JSONDecodeError, match="Unterminated string"):
        loads_bounded(text, LIMITS)
