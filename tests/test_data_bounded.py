"""Data files are bounded by what is used: the first max rows are read, parquet in batches whose
rows are sized (dictionaries expanded) before they are decoded, with the jsonl row limits."""

from __future__ import annotations

import json
import logging
import re
import tracemalloc
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from creditrl.config.schema import DataConfig
from creditrl.data import build_datasets, parquet, rows
from creditrl.data.parquet import row_sizes
from creditrl.data.rows import RowError, read_rows, read_rows_from_files
from creditrl.errors import DataError
from creditrl.preflight import data_sources

LONG = "What is 2 + 2? " * 100  # 1500 characters


def many_rows_parquet(path: Path, count: int = 1_000_000) -> str:
    """``count`` rows of the same long prompt, dictionary-encoded: a few KB on disk, gigabytes
    once every row is decoded."""

    def repeated(value: str) -> pa.DictionaryArray:
        return pa.DictionaryArray.from_arrays(pa.array([0] * count, pa.int32()), pa.array([value]))

    table = pa.table(
        {"prompt": repeated(LONG), "ground_truth": repeated("4"), "data_source": repeated("toy")}
    )
    pq.write_table(table, path, compression="zstd")
    return str(path)


def test_parquet_of_a_million_dictionary_rows_reads_what_is_used(tmp_path: Path) -> None:
    path = many_rows_parquet(tmp_path / "many.parquet")
    assert (tmp_path / "many.parquet").stat().st_size < 200_000
    pool = pa.proxy_memory_pool(pa.default_memory_pool())
    previous = pa.default_memory_pool()
    pa.set_memory_pool(pool)
    tracemalloc.start()
    try:
        got = read_rows(path, "data.train_files", max_rows=100)
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(previous)
    assert len(got) == 100
    assert got[0].messages == [{"role": "user", "content": LONG}]
    assert got[99].ground_truth == "4" and got[99].source == f"row 100 of {path}"
    # all rows decoded: 1.5 GB of text alone
    assert pool.max_memory() < 16 << 20 and python_peak < 16 << 20


def test_large_jsonl_decodes_only_the_rows_used(tmp_path: Path, monkeypatch, caplog) -> None:
    path = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "p", "ground_truth": 1, "data_source": "toy"}) + "\n"
    path.write_text(line * 200_000)
    decoded = []
    real = rows.loads_bounded
    monkeypatch.setattr(rows, "loads_bounded", lambda *a: decoded.append(1) or real(*a))
    with caplog.at_level(logging.WARNING, "creditrl.data.rows"):
        got = read_rows_from_files([str(path)], None, "data.train_files", 5, "data.max_train_rows")
    assert len(got) == 5 and len(decoded) == 5
    assert caplog.messages == [
        f"data.train_files: using the first 5 rows (data.max_train_rows); not read: "
        f"row 6 of {path} on"
    ]


def write_jsonl(path: Path, count: int, start: int = 0) -> str:
    rows_ = [{"prompt": f"q{i}", "ground_truth": i, "data_source": "toy"} for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_[start:]))
    return str(path)


def test_rows_are_the_first_ones_file_by_file(tmp_path: Path, caplog) -> None:
    """The rows taken depend only on the files and the limit; a file after the limit is not
    opened (this one is not parquet at all)."""
    first = write_jsonl(tmp_path / "a.jsonl", 3)
    second = write_jsonl(tmp_path / "b.jsonl", 6, start=3)
    unread = tmp_path / "c.parquet"
    unread.write_bytes(b"not parquet")
    paths = [first, second, str(unread)]
    got = read_rows_from_files(paths, None, "data.train_files", 6, "data.max_train_rows")
    assert [r.ground_truth for r in got] == [0, 1, 2, 3, 4, 5]
    assert caplog.messages[-1].endswith(f"not read: {unread}")
    assert [r.ground_truth for r in read_rows_from_files(paths, max_rows=4)] == [0, 1, 2, 3]
    with pytest.raises(DataError, match="is not a readable parquet file"):
        read_rows_from_files(paths, max_rows=7)


def test_parquet_row_over_the_row_limit_is_refused_before_decoding(
    tmp_path: Path, monkeypatch
) -> None:
    path = many_rows_parquet(tmp_path / "rows.parquet", count=3)
    monkeypatch.setattr(rows, "ROW_LIMITS", replace(rows.ROW_LIMITS, max_bytes=1000))
    decoded = []
    monkeypatch.setattr(rows, "parse_row", lambda *a: decoded.append(a))
    message = f"row 1 of {path} holds 1528 bytes of values decoded, more than the limit of 1000"
    with pytest.raises(RowError, match=f"^{re.escape(message)} bytes$"):
        read_rows(path)
    assert decoded == []


def test_rows_of_a_split_are_bounded_in_total(tmp_path: Path, monkeypatch) -> None:
    path = many_rows_parquet(tmp_path / "rows.parquet", count=10)
    monkeypatch.setattr(rows, "MAX_TOTAL_BYTES", 5000)
    with pytest.raises(DataError, match=r"^k: the rows up to row 4 of .* more than 5000 bytes"):
        read_rows_from_files([path], key="k", max_rows=10, max_rows_key="data.max_train_rows")
    assert len(read_rows_from_files([path], max_rows=3)) == 3


def test_row_sizes_count_a_dictionary_value_at_each_use() -> None:
    messages = [[{"role": "user", "content": "abc"}], None, [{"role": "system", "content": ""}] * 2]
    dense = pa.record_batch({"messages": pa.array(messages), "extra": pa.array([{"k": 1}] * 3)})
    table = pa.Table.from_batches([dense])
    buffer = pa.BufferOutputStream()
    pq.write_table(table, buffer)
    file = pq.ParquetFile(
        pa.BufferReader(buffer.getvalue()),
        read_dictionary=["messages.list.element.role", "messages.list.element.content"],
    )
    encoded = next(file.iter_batches())
    assert pa.types.is_dictionary(encoded.schema.field("messages").type.value_type.field(0).type)
    # list 8 + struct 8 + role 8+4 + content 8+3, extra: struct 8 + int64 8+8
    assert row_sizes(dense).tolist() == [39 + 24, 8 + 24, 8 + 2 * (16 + 14) + 24]
    assert row_sizes(encoded).tolist() == row_sizes(dense).tolist()


def test_config_keys_bound_datasets_and_preflight(tmp_path: Path, tokenizer) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", 8)
    val = many_rows_parquet(tmp_path / "val.parquet", count=50)
    cfg = DataConfig(
        train_files=[train],
        val_files=[val],
        max_train_rows=6,
        max_val_rows=2,
        max_prompt_length=1024,
    )
    train_set, val_set = build_datasets(cfg, tokenizer)
    assert len(train_set) == 6 and len(val_set) == 2
    assert [train_set[i]["ground_truth"] for i in range(6)] == [0, 1, 2, 3, 4, 5]
    assert data_sources(cfg) == {
        "toy": ("data.train_files", f"row 1 of {train}"),
    }


def test_parquet_batches_follow_the_values_the_file_states(tmp_path: Path, monkeypatch) -> None:
    """Run-length coded lists decode to many values per row: batches shrink to hold about
    MAX_BATCH_VALUES, and a row group stating more than MAX_GROUP_VALUES is refused."""
    path = tmp_path / "lists.parquet"
    messages = [{"role": "user", "content": "hi"}] * 1000
    columns = {"messages": [messages] * 4, "ground_truth": ["1"] * 4, "data_source": ["toy"] * 4}
    pq.write_table(pa.table(columns), path)
    sizes = []
    iter_batches = pq.ParquetFile.iter_batches

    def recording(self, **kwargs):
        sizes.append(kwargs["batch_size"])
        return iter_batches(self, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", recording)
    monkeypatch.setattr(parquet, "MAX_BATCH_VALUES", 5000)
    got = read_rows(path)
    assert len(got) == 4 and len(got[3].messages) == 1000
    assert sizes == [2]  # 2002 values a row
    monkeypatch.setattr(parquet, "MAX_GROUP_VALUES", 8000)
    message = f"{path}: row group 0 holds 8008 values, more than the limit of 8000; "
    with pytest.raises(DataError, match=f"^{re.escape(message)}"):
        read_rows(path)
