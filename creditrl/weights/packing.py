"""Safetensors bytes in memory with one copy each way, for the wire (``creditrl.weights.wire``).

``pack`` copies each tensor straight into one buffer laid out as a safetensors file (an 8-byte
little-endian header length, a JSON header padded with spaces to a multiple of 8, then the
tensors' bytes, largest element size first so every tensor starts aligned): the copy is the
snapshot, no second serialisation. ``unpack`` reads such a buffer back as tensors that are views
of it (no copy) once its header is checked: bounded JSON, each entry exactly ``dtype``,
``shape`` and ``data_offsets`` of known types and ranges, each tensor's byte count that of its
shape, and the tensors tiling the data exactly (no gap, no overlap, nothing after): what
safetensors itself requires. safetensors' own ``load`` reads what ``pack`` writes and ``unpack``
reads what safetensors' ``save`` writes. Never pickled.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from creditrl.bounded_json import JsonLimits, loads_bounded

__all__ = ["HEADER_LIMITS", "buffer", "pack", "unpack"]

HEADER_LIMITS = JsonLimits(max_bytes=64 << 20, max_depth=4, max_items=4_000_000)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_ENTRY = {"dtype", "shape", "data_offsets"}


def buffer(size: int) -> memoryview:
    """A writable ``size``-byte buffer, not zeroed (a ``bytearray`` would be: a pass over the
    memory before a byte is written)."""
    return memoryview(torch.empty(size, dtype=torch.uint8).numpy())


@torch.no_grad()
def pack(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> memoryview:
    """``tensors`` (any device, any layout) and ``metadata`` as one safetensors buffer (every
    byte written): each tensor's bytes copied once, into place."""
    order = sorted(tensors, key=lambda name: (-tensors[name].element_size(), name))
    header: dict[str, Any] = {"__metadata__": metadata}
    end = 0
    for name in order:
        tensor = tensors[name]
        if tensor.dtype not in _NAMES:
            raise ValueError(f"tensor {name[:80]}: {tensor.dtype} has no safetensors name")
        start, end = end, end + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [start, end]}  # fmt: skip
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    base = 8 + len(head)
    out = buffer(base + end)
    out[:8] = len(head).to_bytes(8, "little")
    out[8:base] = head
    for name in order:
        tensor = tensors[name]
        if tensor.numel():
            offset = base + header[name]["data_offsets"][0]
            place = torch.frombuffer(out, dtype=tensor.dtype, count=tensor.numel(), offset=offset)
            place.view(tensor.shape).copy_(tensor)
    return out


def unpack(
    payload: bytes | bytearray | memoryview, limits: JsonLimits = HEADER_LIMITS
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors buffer, its header checked (module docstring);
    ValueError naming the first thing that is not so. The tensors are views of ``payload``
    when it is a writable buffer (a read-only one is copied first, once)."""
    view = memoryview(payload).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    if len(view) < 8:
        raise ValueError(f"{len(view)} bytes hold no safetensors header")
    size = int.from_bytes(view[:8], "little")
    if size > min(len(view) - 8, limits.max_bytes):
        raise ValueError(f"a header of {size} bytes in {len(view)} bytes")
    header = loads_bounded(bytes(view[8 : 8 + size]), limits)
    if not isinstance(header, dict):
        raise ValueError("the safetensors header is not a mapping")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise ValueError("the safetensors metadata is not {string: string}")
    base, data = 8 + size, len(view) - 8 - size
    spans = sorted((_span(name, entry, data), name) for name, entry in header.items())
    end = 0
    for (start, stop), name in spans:
        if start != end:
            raise ValueError(f"tensor {name[:80]} starts at {start}, not where the last ended")
        end = stop
    if end != data:
        raise ValueError(f"the tensors end at byte {end} of {data}")
    tensors = {}
    for (start, stop), name in spans:
        dtype, shape = _DTYPES[header[name]["dtype"]], header[name]["shape"]
        count = math.prod(shape)
        if not count:
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        at = base + start
        aligned = at % dtype.itemsize == 0
        source, offset = (view, at) if aligned else (bytearray(view[at : base + stop]), 0)
        flat = torch.frombuffer(source, dtype=dtype, count=count, offset=offset)
        tensors[name] = flat.view(shape)
    return tensors, metadata


def _span(name: str, entry: Any, data: int) -> tuple[int, int]:
    """The (start, stop) data offsets of one header entry, its fields checked."""
    if not isinstance(entry, dict) or entry.keys() != _ENTRY:
        raise ValueError(f"tensor {name[:80]}: an entry is exactly {sorted(_ENTRY)}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _DTYPES:
        raise ValueError(f"tensor {name[:80]}: dtype {str(dtype)[:20]!r} is not one of {_DTYPES}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"tensor {name[:80]}: shape is not a list of counts")
    pair = isinstance(offsets, list) and len(offsets) == 2
    if (
        not pair
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data
    ):
        raise ValueError(f"tensor {name[:80]}: data_offsets are not [start, stop] in [0, {data}]")
    if offsets[1] - offsets[0] != math.prod(shape) * _DTYPES[dtype].itemsize:
        raise ValueError(f"tensor {name[:80]}: {offsets[1] - offsets[0]} bytes for shape {shape}")
    return offsets[0], offsets[1]
