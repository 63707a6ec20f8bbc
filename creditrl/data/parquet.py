"""Raw rows of a parquet data file, read in bounded batches and sized before they are decoded.

A parquet file stores a value repeated a million times once (dictionary encoding) and a long
run of list entries as one run-length code, so a few kilobytes on disk can decode to gigabytes.
Here only the columns a row uses are read, in batches of at most ``BATCH_ROWS`` rows, fewer
where the file's metadata states more than ``MAX_BATCH_VALUES`` leaf values per batch, and a
row group stating more than ``MAX_GROUP_VALUES`` is refused; every text column is kept
dictionary-encoded in Arrow (each distinct value held once), and each row's decoded size,
dictionaries expanded, is computed from the Arrow arrays (``row_sizes``) before the row becomes
Python objects, so the caller can refuse a row or stop reading before that size is ever
allocated. Rows are read in file order, so the first rows of a file are the same on every
read.
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

__all__ = [
    "BATCH_ROWS",
    "MAX_BATCH_VALUES",
    "MAX_GROUP_VALUES",
    "ROW_COLUMNS",
    "iter_parquet",
    "row_sizes",
]

BATCH_ROWS = 256
MAX_BATCH_VALUES = 1 << 20  # leaf values (list entries, struct fields) per batch, on average
MAX_GROUP_VALUES = 1 << 26  # leaf values one row group of the columns read may state
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


def _batch_rows(file: pq.ParquetFile, columns: list[str], path: str) -> int:
    """Rows per batch: ``BATCH_ROWS``, fewer where a row group states more leaf values per row
    in ``columns`` than ``MAX_BATCH_VALUES // BATCH_ROWS``; DataError for a row group stating
    more than ``MAX_GROUP_VALUES``."""
    meta = file.metadata
    per_row = 1
    for index in range(meta.num_row_groups):
        group = meta.row_group(index)
        chunks = (group.column(c) for c in range(group.num_columns))
        values = sum(c.num_values for c in chunks if c.path_in_schema.split(".")[0] in columns)
        if values > MAX_GROUP_VALUES:
            raise DataError(
                f"{path}: row group {index} holds {values} values, more than the limit of "
                f"{MAX_GROUP_VALUES}; write the file with smaller row groups"
            )
        per_row = max(per_row, -(-values // max(group.num_rows, 1)))
    return max(1, min(BATCH_ROWS, MAX_BATCH_VALUES // per_row))


def iter_parquet(path: str) -> Iterator[tuple[int, Callable[[], dict[str, Any]]]]:
    """``(decoded bytes, decode)`` for each row of the file in order; ``decode()`` gives the
    row as a dict of the ``ROW_COLUMNS`` the file has. A caller checks the size first and stops
    or refuses before decoding: beyond the rows it decodes, at most one batch (see the module
    doc) is held in Arrow and ``BATCH_BYTES`` as Python rows."""
    file = _open(path)
    columns = [name for name in file.schema_arrow.names if name in ROW_COLUMNS]
    size = _batch_rows(file, columns, path)
    batches = file.iter_batches(batch_size=size, columns=columns, use_threads=False)
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
