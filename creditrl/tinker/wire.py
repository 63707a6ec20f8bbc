"""The protocol-buffer wire format, as much as the Tinker SDK's binary bodies need.

The SDK sends ``forward_backward`` requests and reads ``forward_backward`` and ``sample``
results as protocol buffers. This module reads a message into its fields (``read_fields``,
bounded: a count of fields, varints of at most 10 bytes, lengths inside the buffer, no groups)
and writes fields (``varint_field``, ``bytes_field``, ``double_field``); the message shapes
themselves (which field number holds what) are in ``creditrl.tinker.messages``.
"""

from __future__ import annotations

import struct
from collections import defaultdict

__all__ = [
    "WireError",
    "as_bytes",
    "as_double",
    "as_int",
    "bytes_field",
    "double_field",
    "packed_ints",
    "read_fields",
    "text",
    "varint_field",
]

VARINT, FIXED64, LENGTH, FIXED32 = 0, 1, 2, 5
Value = int | bytes
Fields = dict[int, list[Value]]


class WireError(ValueError):
    """A body that is not a well-formed message of the expected shape (one line)."""


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    for _ in range(10):
        if pos >= len(data):
            raise WireError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & ((1 << 64) - 1), pos
        shift += 7
    raise WireError("varint longer than 10 bytes")


def read_fields(data: bytes | memoryview, max_fields: int) -> Fields:
    """Every field of one message: field number -> its values in order (an int for varint
    and fixed-width fields, the bytes of a length-delimited one). WireError past
    ``max_fields`` fields, on a truncated field or on a wire type the format does not use."""
    view = memoryview(data)
    fields: Fields = defaultdict(list)
    pos = count = 0
    while pos < len(view):
        count += 1
        if count > max_fields:
            raise WireError(f"more than {max_fields} fields in one message")
        key, pos = _varint(view, pos)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        if kind == VARINT:
            value, pos = _varint(view, pos)
        elif kind in (FIXED64, FIXED32):
            width = 8 if kind == FIXED64 else 4
            if pos + width > len(view):
                raise WireError("truncated fixed-width field")
            value = int.from_bytes(view[pos : pos + width], "little")
            pos += width
        elif kind == LENGTH:
            size, pos = _varint(view, pos)
            if size > len(view) - pos:
                raise WireError("length-delimited field runs past the end of the message")
            value = bytes(view[pos : pos + size])
            pos += size
        else:
            raise WireError(f"wire type {kind} is not used by this protocol")
        fields[number].append(value)
    return fields


def _last(fields: Fields, number: int) -> Value | None:
    values = fields.get(number)
    return values[-1] if values else None


def as_int(fields: Fields, number: int, signed: bool = True) -> int:
    """The last value of a varint field (0 when absent), as a signed 64-bit int when
    ``signed``."""
    value = _last(fields, number)
    if value is None:
        return 0
    if not isinstance(value, int):
        raise WireError(f"field {number} is not an integer")
    return value - (1 << 64) if signed and value >= 1 << 63 else value


def as_bytes(fields: Fields, number: int) -> bytes:
    """The last value of a length-delimited field (empty when absent)."""
    value = _last(fields, number)
    if value is None:
        return b""
    if not isinstance(value, bytes):
        raise WireError(f"field {number} is not length-delimited")
    return value


def as_double(fields: Fields, number: int) -> float:
    """The last value of a ``double`` field (0.0 when absent)."""
    value = _last(fields, number)
    if value is None:
        return 0.0
    if not isinstance(value, int):
        raise WireError(f"field {number} is not a double")
    return struct.unpack("<d", value.to_bytes(8, "little"))[0]


def text(value: Value, limit: int = 1024) -> str:
    """A ``string`` field's value: UTF-8 of at most ``limit`` bytes."""
    if not isinstance(value, bytes) or len(value) > limit:
        raise WireError(f"expected a string of at most {limit} bytes")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise WireError("a string field is not UTF-8") from None


def packed_ints(fields: Fields, number: int, limit: int) -> list[int]:
    """A repeated int64 field, packed or not; at most ``limit`` values."""
    out: list[int] = []
    for value in fields.get(number, []):
        if isinstance(value, int):
            out.append(value)
            continue
        pos = 0
        while pos < len(value):
            item, pos = _varint(value, pos)
            out.append(item)
            if len(out) > limit:
                break
        if len(out) > limit:
            break
    if len(out) > limit:
        raise WireError(f"more than {limit} values in field {number}")
    return [v - (1 << 64) if v >= 1 << 63 else v for v in out]


def _key(number: int, kind: int) -> bytes:
    return _encode_varint(number << 3 | kind)


def _encode_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def varint_field(number: int, value: int) -> bytes:
    """One varint field (an int, enum or bool); nothing for 0 (proto3's default)."""
    return _key(number, VARINT) + _encode_varint(value) if value else b""


def bytes_field(number: int, value: bytes | str) -> bytes:
    """One length-delimited field: bytes, a string or an encoded message."""
    raw = value.encode("utf-8") if isinstance(value, str) else value
    return _key(number, LENGTH) + _encode_varint(len(raw)) + raw


def double_field(number: int, value: float) -> bytes:
    """One ``double`` field."""
    return _key(number, FIXED64) + struct.pack("<d", value)
