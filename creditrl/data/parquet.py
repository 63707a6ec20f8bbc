"""Raw rows of a parquet data file, read in bounded batches and sized before they are decoded.

A parquet file stores a value repeated a million times once (dictionary encoding), so a few
kilobytes on disk can decode to gigabytes. Here only the columns a row uses are read, in
batches of ``BATCH_ROWS`` rows, with every text column kept dictionary-encoded in Arrow (each
distinct value held once); each row's decoded size, dictionaries expanded, is computed from the
Arrow arrays (``row_sizes``) before the row becomes Python objects, so the caller can refuse a
row or stop reading before that size is ever allocated. Rows are read in file order, so
the first rows of a file are the same on every read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from creditrl.errors import DataError
from creditrl.usercode import one_line

__all__ = ["BATCH_ROWS", "ROW_COLUMNS", "iter_parquet", "row_sizes"]

BATCH_ROWS = 256
# the top-level columns parse_row reads; the others are not read at all
ROW_COLUMNS = (
    "prompt",
    "messages",
    "ground_truth",
    "reward_model",
    "data_source",
    "extra",
    "extra_info",
)
VALUE_OVERHEAD = 8  # bytes counted per value besides its content, so empty values count too
BATCH_BYTES = 16 << 20  # a batch this small (decoded) becomes Python rows at once, else row by row
_TEXT_TYPES = (
    pa.types.is_string,
    pa.types.is_binary,
    pa.types.is_large_string,
    pa.types.is_large_binary,
)


def _value_sizes(array: pa.Array) -> np.ndarray:
    """Bytes each entry of ``array`` decodes to (``VALUE_OVERHEAD`` per value plus text bytes),
    without decoding it; int64, one per entry."""
    kind = array.type
    if pa.types.is_dictionary(kind):
        indices = array.indices.fill_null(0).to_numpy(zero_copy_only=False)
        return _value_sizes(array.dictionary)[indices] if len(array.dictionary) else indices * 0
    if any(test(kind) for test in _TEXT_TYPES):
        lengths = pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False)
        return lengths.astype(np.int64) + VALUE_OVERHEAD
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind):
        offsets = array.offsets.to_numpy(zero_copy_only=False)
        inner = np.concatenate(([0], np.cumsum(_value_sizes(array.values))))
        return inner[offsets[1:]] - inner[offsets[:-1]] + VALUE_OVERHEAD
    if pa.types.is_fixed_size_list(kind):
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        inner = _value_sizes(pc.list_flatten(array))
        sizes = np.bincount(parents, weights=inner, minlength=len(array)).astype(np.int64)
        return sizes + VALUE_OVERHEAD
    if pa.types.is_struct(kind):
        sizes = np.full(len(array), VALUE_OVERHEAD, dtype=np.int64)
        for field in array.flatten():
            sizes += _value_sizes(field)
        return sizes
    width = kind.bit_width // 8 if pa.types.is_primitive(kind) and kind.bit_width >= 8 else 0
    return np.full(len(array), VALUE_OVERHEAD + width, dtype=np.int64)


def row_sizes(batch: pa.RecordBatch) -> np.ndarray:
    """Bytes each row of ``batch`` holds once decoded (dictionary values counted per use)."""
    sizes = np.zeros(batch.num_rows, dtype=np.int64)
    for column in batch.columns:
        sizes += _value_sizes(column)
    return sizes


def _text_columns(schema: pq.ParquetSchema) -> list[str]:
    """Paths of the text leaf columns, read dictionary-encoded."""
    return [
        column.path
        for column in (schema.column(i) for i in range(len(schema)))
        if column.physical_type == "BYTE_ARRAY" and column.logical_type.type in ("STRING", "NONE")
    ]


def _open(path: str) -> pq.ParquetFile:
    try:
        file = pq.ParquetFile(path)
        return pq.ParquetFile(path, read_dictionary=_text_columns(file.schema))
    except (pa.ArrowException, OSError, ValueError) as e:
        raise DataError(
            f"{path} is not a readable parquet file: {type(e).__name__}: {one_line(e)}"
        ) from None


def iter_parquet(path: str) -> Iterator[tuple[int, Callable[[], dict[str, Any]]]]:
    """``(decoded bytes, decode)`` for each row of the file in order; ``decode()`` gives the
    row as a dict of the ``ROW_COLUMNS`` the file has. A caller checks the size first and stops
    or refuses before decoding: beyond the rows it decodes, at most one batch of
    ``BATCH_ROWS`` rows is held in Arrow (text dictionary-encoded) and ``BATCH_BYTES`` as
    Python rows."""
    file = _open(path)
    columns = [name for name in file.schema_arrow.names if name in ROW_COLUMNS]
    batches = file.iter_batches(batch_size=BATCH_ROWS, columns=columns, use_threads=False)
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataError(
                f"{path} is not a readable parquet file: {type(e).__name__}: {one_line(e)}"
            ) from None
        sizes = row_sizes(batch)
        rows = batch.to_pylist() if sizes.sum() <= BATCH_BYTES else None
        for i in range(batch.num_rows):
            if rows is not None:
                yield int(sizes[i]), partial(rows.__getitem__, i)
            else:
                yield int(sizes[i]), partial(_decode_row, batch, i)


def _decode_row(batch: pa.RecordBatch, index: int) -> dict[str, Any]:
    return batch.slice(index, 1).to_pylist()[0]
