"""Pickle-free serialization of a Batch's parts: safetensors for tensors, JSON for the rest.

On disk a batch is a directory holding ``tensors.safetensors`` and ``batch.json`` (batch size,
tensor key order, non-tensor columns, meta). In memory (``to_bytes``) it is
``MAGIC | uint64 little-endian JSON length | JSON header | safetensors payload``.
Non-tensor values and meta may only hold str, int, float, bool, None, list and dicts with str
keys, so that loading gives back exactly what was saved.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch

__all__ = ["check_json", "decode", "encode", "read_dir", "split", "write_dir"]

FORMAT = "creditrl.batch/1"
MAGIC = b"CRLBATCH"
TENSORS_FILE = "tensors.safetensors"
HEADER_FILE = "batch.json"

# (batch size, tensors in key order, non-tensor columns, meta)
Parts = tuple[int, dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]


def _first_bad(value: Any) -> tuple[str, str] | None:
    """(path inside value, reason) of the first non-JSON-exact item, or None."""
    if value is None or isinstance(value, str | int | float):
        return None
    if isinstance(value, list):
        items: Any = enumerate(value)
    elif isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                return f"[{key!r}]", f"dict key of type {type(key).__name__} is not a str"
        items = value.items()
    else:
        return "", f"{type(value).__name__} is not JSON-serialisable"
    for key, item in items:
        bad = _first_bad(item)
        if bad is not None:
            return f"[{key!r}]{bad[0]}", bad[1]
    return None


def check_json(value: Any, where: str) -> None:
    """Raise TypeError naming ``where`` unless ``value`` survives a JSON round trip exactly."""
    bad = _first_bad(value)
    if bad is not None:
        raise TypeError(
            f"{where}{bad[0]}: {bad[1]} (allowed: str, int, float, bool, None, list, "
            "dict with str keys; convert numpy scalars with .item())"
        )


def _header(parts: Parts) -> dict[str, Any]:
    size, tensors, non_tensors, meta = parts
    columns = {}
    for name, column in non_tensors.items():
        values = column.tolist() if isinstance(column, np.ndarray) else list(column)
        for i, value in enumerate(values):
            check_json(value, f"non-tensor field {name!r}[{i}]")
        columns[name] = values
    for key, value in meta.items():
        check_json(value, f"meta[{key!r}]")
    return {
        "format": FORMAT,
        "batch_size": size,
        "tensor_keys": list(tensors),
        "non_tensors": columns,
        "meta": meta,
    }


def _payload(tensors: dict[str, torch.Tensor]) -> bytes:
    # A fresh contiguous CPU copy per tensor: safetensors refuses views sharing storage.
    plain = {
        k: v.detach().to("cpu", copy=True, memory_format=torch.contiguous_format)
        for k, v in tensors.items()
    }
    return safetensors.torch.save(plain)


def _parts(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Parts:
    if header.get("format") != FORMAT:
        raise ValueError(f"not a creditrl batch (format {header.get('format')!r})")
    keys = header["tensor_keys"]
    if set(keys) != set(tensors):
        raise ValueError(f"tensor keys {sorted(tensors)} do not match the header's {sorted(keys)}")
    return (
        header["batch_size"],
        {k: tensors[k] for k in keys},
        header["non_tensors"],
        header["meta"],
    )


def encode(parts: Parts) -> bytes:
    """Serialize parts to ``MAGIC | len | JSON | safetensors`` bytes."""
    head = json.dumps(_header(parts)).encode()
    return MAGIC + struct.pack("<Q", len(head)) + head + _payload(parts[1])


def split(data: bytes) -> tuple[memoryview, memoryview]:
    """The JSON header and the safetensors payload of ``encode``'s bytes, as views (no copy);
    ValueError unless ``data`` is framed as a creditrl batch."""
    view = memoryview(data)
    start = len(MAGIC) + 8
    if bytes(view[: len(MAGIC)]) != MAGIC or len(view) < start:
        raise ValueError("not a creditrl batch (bad magic bytes)")
    (length,) = struct.unpack("<Q", view[len(MAGIC) : start])
    if length > len(view) - start:
        raise ValueError(f"JSON header of {length} bytes declared, {len(view) - start} follow")
    return view[start : start + length], view[start + length :]


def decode(data: bytes) -> Parts:
    """Inverse of ``encode`` (the JSON header must be UTF-8, as ``encode`` writes it)."""
    head, tensors = split(data)
    header = json.loads(bytes(head).decode("utf-8"))
    return _parts(header, safetensors.torch.load(bytes(tensors)))


def _write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_dir(path: str | os.PathLike[str], parts: Parts) -> None:
    """Write parts to directory ``path`` atomically (temp dir, then rename).

    An existing ``path`` is replaced only if it is a previously saved batch directory.
    """
    path = Path(path)
    header = json.dumps(_header(parts), indent=1).encode()
    payload = _payload(parts[1])
    if path.exists() and not (path / HEADER_FILE).is_file():
        raise FileExistsError(f"{path} exists and is not a saved batch; refusing to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        _write(tmp / TENSORS_FILE, payload)
        _write(tmp / HEADER_FILE, header)
        if path.exists():
            old = tmp.with_suffix(".old")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def read_dir(path: str | os.PathLike[str]) -> Parts:
    """Read parts written by ``write_dir`` (tensors on CPU)."""
    path = Path(path)
    header = json.loads((path / HEADER_FILE).read_bytes())
    return _parts(header, safetensors.torch.load_file(path / TENSORS_FILE))
