"""Batch: the container every training stage takes and returns (the role of verl's DataProto)."""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from creditrl.batch import io
from creditrl.batch.fields import FIELDS

__all__ = ["Batch", "pad_to_divisor", "unpad"]

Index = int | slice | Sequence[int] | Sequence[bool] | torch.Tensor | np.ndarray


def _catalogue_note(name: str) -> str:
    return f"; catalogue: {FIELDS[name].line()}" if name in FIELDS else ""


def _object_array(name: str, value: Any) -> np.ndarray:
    """A 1-D numpy object array (one Python value per sample) from a list or numpy array."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non-tensor field {name!r} has no batch dimension (0-d array)")
        if value.dtype == object and value.ndim == 1:
            return value
        value = value.tolist()
    elif not isinstance(value, list | tuple):
        raise TypeError(
            f"non-tensor field {name!r} must be a list or numpy array, got {type(value).__name__}"
        )
    return np.fromiter(value, dtype=object, count=len(value))


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and values (NaN equals NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    if torch.equal(a, b):
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return False


def _values_equal(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return _tensors_equal(a, b)
    try:
        return bool(a == b)
    except (ValueError, RuntimeError, TypeError):
        return bool(np.array_equal(a, b)) if isinstance(a, np.ndarray) else False


def _columns_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b, strict=True))


class Batch:
    """Tensors sharing batch dim B, per-sample non-tensors and a JSON-serialisable ``meta``.

    - ``tensors``: a ``TensorDict`` with ``batch_size=[B]``.
    - ``non_tensors``: ``{name: numpy object array of length B}`` (strings, dicts, uids).
    - ``meta``: ``{name: value}`` for the whole batch (step, temperature, flags).

    Tensor and non-tensor names share one namespace: ``batch["responses"]``, ``batch["uid"]``.
    Selections (``select``, ``batch[2:5]``) share tensor storage where torch indexing does; the
    result's ``meta`` is a shallow copy. ``batch[i]`` with an int is a Batch of length 1.
    Standard field names are documented in ``creditrl.batch.FIELDS``.
    """

    tensors: TensorDict
    non_tensors: dict[str, np.ndarray]
    meta: dict[str, Any]

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | TensorDict | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        *,
        batch_size: int | None = None,
    ) -> None:
        tensors = dict(tensors.items()) if tensors is not None else {}
        columns = {k: _object_array(k, v) for k, v in (non_tensors or {}).items()}
        for name, value in tensors.items():
            if not isinstance(name, str):
                raise TypeError(f"field names must be str, got {name!r}")
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"tensor field {name!r} must be a torch.Tensor, got {type(value).__name__}"
                )
            if value.ndim == 0:
                raise ValueError(f"tensor field {name!r} is 0-d; it needs a batch dimension")
        both = sorted(set(tensors) & set(columns))
        if both:
            raise ValueError(f"fields {both} are given both as tensors and as non-tensors")
        fields = {**tensors, **columns}
        source = "batch_size"
        if batch_size is None:
            source, first = next(iter(fields.items()), ("no fields", []))
            batch_size = len(first)
        for name, value in fields.items():
            if len(value) != batch_size:
                raise ValueError(
                    f"field {name!r} has first dim {len(value)}, but the batch size is "
                    f"{batch_size} (from {source!r}){_catalogue_note(name)}"
                )
        self.tensors = TensorDict(tensors, batch_size=[batch_size])
        self.non_tensors = columns
        self.meta = dict(meta or {})

    @classmethod
    def _make(
        cls, tensors: TensorDict, non_tensors: dict[str, np.ndarray], meta: dict[str, Any]
    ) -> Batch:
        """Build without validation (for operations that preserve the invariants)."""
        out = cls.__new__(cls)
        out.tensors, out.non_tensors, out.meta = tensors, non_tensors, meta
        return out

    @classmethod
    def from_dict(
        cls,
        tensors: Mapping[str, torch.Tensor],
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> Batch:
        """Build from tensors, non-tensors (lists or numpy arrays; made object arrays), meta."""
        return cls(tensors, non_tensors, meta)

    # ---- mapping-style access -------------------------------------------------------------

    def __len__(self) -> int:
        return self.tensors.batch_size[0]

    def keys(self) -> list[str]:
        """Tensor names, then non-tensor names."""
        return [*self.tensors.keys(), *self.non_tensors]

    def __contains__(self, key: object) -> bool:
        return key in self.non_tensors or key in self.tensors

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key`` if present, else ``default``."""
        if key in self.non_tensors:
            return self.non_tensors[key]
        return self.tensors.get(key, default)

    def _missing(self, key: str) -> KeyError:
        return KeyError(f"batch has no field {key!r} (fields: {self.keys()}){_catalogue_note(key)}")

    def __getitem__(self, item: str | Index) -> Any:
        """``batch["name"]`` gives a field; any other index gives a Batch of those samples.

        Indices: int (a Batch of length 1), slice, list/array/LongTensor of positions, or a
        bool mask (list, numpy array or tensor) of length B.
        """
        if isinstance(item, str):
            if item in self.non_tensors:
                return self.non_tensors[item]
            if item in self.tensors:
                return self.tensors[item]
            raise self._missing(item)
        return self._take(item)

    def __setitem__(self, key: str, value: Any) -> None:
        """Set a tensor (torch.Tensor) or non-tensor (list / numpy array) field of length B."""
        if not isinstance(key, str):
            raise TypeError(f"assign fields by name, got {key!r}")
        if isinstance(value, torch.Tensor):
            if value.ndim == 0:
                raise ValueError(f"tensor field {key!r} is 0-d; it needs a batch dimension")
            n = len(value)
        else:
            value = _object_array(key, value)
            n = len(value)
        if n != len(self):
            raise ValueError(
                f"field {key!r} has first dim {n}, but the batch size is {len(self)}"
                f"{_catalogue_note(key)}"
            )
        if key in self:
            del self[key]
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.non_tensors[key] = value

    def __delitem__(self, key: str) -> None:
        if key in self.non_tensors:
            del self.non_tensors[key]
        elif key in self.tensors:
            del self.tensors[key]
        else:
            raise self._missing(key)

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{k}: {str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
            for k, v in self.tensors.items()
        )
        return (
            f"Batch(len={len(self)}, tensors={{{tensors}}}, "
            f"non_tensors={list(self.non_tensors)}, meta={self.meta})"
        )

    # ---- selecting and indexing ------------------------------------------------------------

    def select(self, *keys: str) -> Batch:
        """A new Batch with only ``keys`` (tensor or non-tensor), sharing storage."""
        for key in keys:
            if key not in self:
                raise self._missing(key)
        tensor_keys = [k for k in keys if k not in self.non_tensors]
        return self._make(
            self.tensors.select(*tensor_keys),
            {k: self.non_tensors[k] for k in keys if k in self.non_tensors},
            dict(self.meta),
        )

    def pop(self, *keys: str) -> Batch:
        """Remove ``keys`` from this batch and return them as a new Batch."""
        out = self.select(*keys)
        for key in keys:
            del self[key]
        return out

    def rename(self, old: str, new: str) -> Batch:
        """Rename field ``old`` to ``new`` in place; returns self."""
        if old not in self:
            raise self._missing(old)
        if new in self and new != old:
            raise ValueError(f"cannot rename {old!r} to {new!r}: {new!r} already exists")
        if old in self.non_tensors:
            self.non_tensors[new] = self.non_tensors.pop(old)
        else:
            self.tensors.rename_key_(old, new)
        return self

    def _take(self, index: Index) -> Batch:
        size = len(self)
        if isinstance(index, torch.Tensor | np.ndarray) and index.ndim == 0:
            index = index.item()
        if isinstance(index, int | np.integer) and not isinstance(index, bool | np.bool_):
            i = operator.index(index)
            if not -size <= i < size:
                raise IndexError(f"index {i} out of range for a batch of {size}")
            index = slice(i % size, i % size + 1)
        if isinstance(index, slice) and (index.step or 1) > 0:
            positions: Any = index
            rows: Any = index
        else:
            positions = self._positions(index)
            rows = positions.numpy()
        return self._make(
            self.tensors[positions],
            {k: v[rows] for k, v in self.non_tensors.items()},
            dict(self.meta),
        )

    def _positions(self, index: Any) -> torch.Tensor:
        """A LongTensor of positions from a slice, integer sequence or bool mask."""
        if isinstance(index, slice):
            index = range(len(self))[index]
        if isinstance(index, range):
            index = list(index)
        t = torch.as_tensor(index).cpu()
        if t.dtype == torch.bool:
            if t.shape != (len(self),):
                raise IndexError(f"bool mask of shape {tuple(t.shape)} for a batch of {len(self)}")
            return t.nonzero().flatten()
        if t.numel() == 0:
            return torch.zeros(0, dtype=torch.long)
        if t.is_floating_point() or t.is_complex() or t.ndim != 1:
            raise IndexError(f"cannot index a batch with {index!r}")
        t = t.long()
        if bool(((t < -len(self)) | (t >= len(self))).any()):
            raise IndexError(f"index out of range for a batch of {len(self)}")
        return t % max(len(self), 1)

    # ---- combining -------------------------------------------------------------------------

    def union(self, other: Batch) -> Batch:
        """Merge fields and meta of two batches of equal length into a new Batch.

        A key present in both must hold equal values (tensors: same dtype, shape and values;
        non-tensors: element-wise ==; meta: ==), else ValueError naming the key.
        """
        if len(other) != len(self):
            raise ValueError(f"cannot union batches of length {len(self)} and {len(other)}")
        tensors = dict(self.tensors.items())
        columns = dict(self.non_tensors)
        meta = dict(self.meta)
        for key, value in other.tensors.items():
            if key in columns or (key in tensors and not _tensors_equal(tensors[key], value)):
                raise ValueError(f"union conflict on key {key!r}: the batches differ there")
            tensors[key] = tensors.get(key, value)
        for key, column in other.non_tensors.items():
            if key in tensors or (key in columns and not _columns_equal(columns[key], column)):
                raise ValueError(f"union conflict on key {key!r}: the batches differ there")
            columns[key] = columns.get(key, column)
        for key, value in other.meta.items():
            if key in meta and not _values_equal(meta[key], value):
                raise ValueError(f"union conflict on meta key {key!r}: {meta[key]!r} != {value!r}")
            meta.setdefault(key, value)
        return self._make(TensorDict(tensors, batch_size=[len(self)]), columns, meta)

    @classmethod
    def concat(cls, batches: Sequence[Batch]) -> Batch:
        """Concatenate along the batch dimension; meta comes from the first batch.

        All batches must hold the same tensor and non-tensor keys with matching dtypes.
        """
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for i, b in enumerate(batches[1:], start=1):
            for kind, mine, theirs in (
                ("tensor", first.tensors.keys(), b.tensors.keys()),
                ("non-tensor", first.non_tensors.keys(), b.non_tensors.keys()),
            ):
                missing, extra = sorted(set(mine) - set(theirs)), sorted(set(theirs) - set(mine))
                if missing or extra:
                    raise ValueError(
                        f"cannot concat: batch {i}'s {kind} keys differ from batch 0's "
                        f"(missing {missing}, extra {extra})"
                    )
        tensors = {}
        for key, value in first.tensors.items():
            parts = [b.tensors[key] for b in batches]
            if any(p.dtype != value.dtype for p in parts):
                raise ValueError(f"cannot concat field {key!r}: dtypes {[p.dtype for p in parts]}")
            try:
                tensors[key] = torch.cat(parts)
            except RuntimeError as e:
                raise ValueError(f"cannot concat field {key!r}: {e}") from e
        columns = {
            k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors
        }
        size = sum(len(b) for b in batches)
        return cls._make(TensorDict(tensors, batch_size=[size]), columns, dict(first.meta))

    # ---- data-parallel shards --------------------------------------------------------------

    def chunk(self, n: int, pad: bool = False) -> list[Batch]:
        """Split into ``n`` equal shards (views).

        ValueError if ``len(self) % n != 0`` unless ``pad=True``: then the batch is first padded
        with ``pad_to_divisor`` (repeating the first samples; pad size ``-len(self) % n``), and
        the caller removes it after concatenating results with ``unpad(merged, pad_size)``.
        """
        batch = self._padded(n, pad)
        size = len(batch) // n
        return [batch[i * size : (i + 1) * size] for i in range(n)]

    def split(self, size: int, pad: bool = False) -> list[Batch]:
        """Split into shards of ``size`` samples; divisibility and ``pad`` as in ``chunk``."""
        batch = self._padded(size, pad)
        return [batch[i : i + size] for i in range(0, len(batch), size)]

    def _padded(self, divisor: int, pad: bool) -> Batch:
        if divisor < 1:
            raise ValueError(f"shard count / size must be >= 1, got {divisor}")
        if len(self) % divisor and not pad:
            raise ValueError(
                f"batch of {len(self)} samples is not divisible by {divisor}; pass pad=True "
                f"(then unpad(merged, {-len(self) % divisor})) or use pad_to_divisor"
            )
        return pad_to_divisor(self, divisor)[0]

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each sample ``n`` times: ``[a, a, b, b]`` if ``interleave`` else ``[a, b, a, b]``.

        Tensors are copied; non-tensor elements (e.g. dicts) are shared references.
        """
        if n < 1:
            raise ValueError(f"repeat needs n >= 1, got {n}")
        rows = torch.arange(len(self))
        return self._take(rows.repeat_interleave(n) if interleave else rows.repeat(n))

    def reorder(self, indices: Sequence[int] | torch.Tensor | np.ndarray) -> None:
        """Permute the samples in place: sample i becomes old sample ``indices[i]``.

        ``indices`` must be a permutation of ``range(len(self))``; use ``batch[indices]`` for
        a new Batch (any selection, repeats allowed).
        """
        positions = torch.as_tensor(indices).long().cpu().flatten()
        if not torch.equal(positions.sort().values, torch.arange(len(self))):
            raise ValueError(f"reorder needs a permutation of range({len(self)})")
        taken = self._take(positions)
        self.tensors, self.non_tensors = taken.tensors, taken.non_tensors

    # ---- devices, comparison, serialization ------------------------------------------------

    def to(self, device: torch.device | str) -> Batch:
        """A new Batch with tensors on ``device`` (non-tensors and meta shared / copied)."""
        return self._make(self.tensors.to(device), dict(self.non_tensors), dict(self.meta))

    def equals(self, other: Batch) -> bool:
        """Exactly equal: same keys, tensor dtypes/shapes/values, non-tensors and meta."""
        return (
            isinstance(other, Batch)
            and len(self) == len(other)
            and set(self.tensors.keys()) == set(other.tensors.keys())
            and set(self.non_tensors) == set(other.non_tensors)
            and all(_tensors_equal(v, other.tensors[k]) for k, v in self.tensors.items())
            and all(_columns_equal(v, other.non_tensors[k]) for k, v in self.non_tensors.items())
            and _values_equal(self.meta, other.meta)
        )

    def _parts(self) -> io.Parts:
        return len(self), dict(self.tensors.items()), self.non_tensors, self.meta

    @classmethod
    def _from_parts(cls, parts: io.Parts) -> Batch:
        size, tensors, columns, meta = parts
        return cls(tensors, columns, meta, batch_size=size)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write to directory ``path`` (safetensors + JSON, atomically; no pickle).

        Non-tensor values and meta must be str/int/float/bool/None/list/dict (TypeError names
        the field otherwise).
        """
        io.write_dir(path, self._parts())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Batch:
        """Read a batch written by ``save`` (tensors on CPU)."""
        return cls._from_parts(io.read_dir(path))

    def to_bytes(self) -> bytes:
        """Serialize to bytes (length-prefixed JSON header + safetensors payload; no pickle)."""
        return io.encode(self._parts())

    @classmethod
    def from_bytes(cls, data: bytes) -> Batch:
        """Inverse of ``to_bytes`` (tensors on CPU)."""
        return cls._from_parts(io.decode(data))


def pad_to_divisor(batch: Batch, divisor: int) -> tuple[Batch, int]:
    """Pad ``batch`` to a multiple of ``divisor`` by repeating its first samples cyclically.

    Returns ``(padded, pad_size)``; ``padded`` is ``batch`` itself when no padding is needed.
    """
    if divisor < 1:
        raise ValueError(f"divisor must be >= 1, got {divisor}")
    pad_size = -len(batch) % divisor
    if pad_size == 0:
        return batch, 0
    rows = torch.cat([torch.arange(len(batch)), torch.arange(pad_size) % len(batch)])
    return batch[rows], pad_size


def unpad(batch: Batch, pad_size: int) -> Batch:
    """Drop the last ``pad_size`` samples (the padding added by ``pad_to_divisor``)."""
    if not 0 <= pad_size <= len(batch):
        raise ValueError(f"pad_size {pad_size} out of range for a batch of {len(batch)}")
    return batch[: len(batch) - pad_size]
