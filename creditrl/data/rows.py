"""Prompt rows from jsonl and parquet files, validated with errors that name the file and row.

A row holds ``prompt`` (text) or ``messages`` (a chat list of ``{"role", "content"}``), plus
``ground_truth`` (any JSON value, null allowed), ``data_source`` (str) and optional ``extra``
(dict). verl-style rows are accepted too: ``prompt`` given as a chat list, ``extra_info`` for
``extra``, ``reward_model.ground_truth`` for ``ground_truth``. Other keys are ignored.
Rows are numbered from 1; in a jsonl file the row number is the line number (blank lines skipped).
Every problem is a one-line ``DataError`` naming the config key, the file and the row.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from creditrl.bounded_json import JsonLimitError, JsonLimits, loads_bounded
from creditrl.errors import DataError

__all__ = [
    "MAX_TOTAL_BYTES",
    "ROLES",
    "ROW_LIMITS",
    "PromptRow",
    "RowError",
    "parse_row",
    "read_rows",
    "read_rows_from_files",
]

ROLES = ("system", "user", "assistant", "tool")
# One row of a jsonl file: 64 MiB (a prompt that long is dropped by its length before it is
# tokenized), nested 64 deep, a million elements
ROW_LIMITS = JsonLimits(max_bytes=64 << 20, max_depth=64, max_items=1 << 20)
# All rows read for one split (one read_rows_from_files call): 4 GiB of lines / decoded values
MAX_TOTAL_BYTES = 4 << 30

logger = logging.getLogger(__name__)


class RowError(DataError):
    """A data row that cannot be used; the message names the file and row."""


@dataclass
class PromptRow:
    """One validated prompt: chat ``messages`` (a text prompt becomes one user message)."""

    messages: list[dict[str, Any]]
    ground_truth: Any
    data_source: str
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # where it came from, for error messages: "data/train.jsonl row 17"
    # the distillation teacher's messages when they differ (creditrl.data.teacher)
    teacher_messages: list[dict[str, Any]] | None = None


def _present(obj: Mapping[str, Any], key: str) -> bool:
    return obj.get(key) is not None


def _check_messages(messages: Any, where: str, key: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RowError(f"{where}: {key!r} must be a non-empty list of chat messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RowError(f"{where}: {key}[{i}] must be a dict, got {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise RowError(f"{where}: {key}[{i}].role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise RowError(
                f"{where}: {key}[{i}].content must be a str, got {type(content).__name__}"
            )
    return [dict(m) for m in messages]


def _as_dict(value: Any, where: str, key: str) -> dict[str, Any]:
    if isinstance(value, list) and all(isinstance(p, tuple) and len(p) == 2 for p in value):
        value = dict(value)  # a parquet map column reads as a list of (key, value) pairs
    if not isinstance(value, Mapping):
        raise RowError(f"{where}: {key!r} must be a dict, got {type(value).__name__}")
    return dict(value)


def _json_safe(value: Any, where: str, key: str) -> None:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as e:
        raise RowError(f"{where}: {key!r} is not JSON-serialisable ({e})") from e
    except RecursionError:
        raise RowError(f"{where}: {key!r} is nested too deep to store") from None


def parse_row(obj: Any, where: str) -> PromptRow:
    """Validate one raw row (a dict) into a PromptRow; ``where`` names it in errors."""
    if not isinstance(obj, Mapping):
        raise RowError(f"{where} is a {type(obj).__name__}, expected an object (dict)")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if messages is not None:
        messages = _check_messages(messages, where, "messages")
    elif isinstance(prompt, list):
        messages = _check_messages(prompt, where, "prompt")
    elif isinstance(prompt, str):
        if not prompt.strip():
            raise RowError(f"{where} has an empty prompt")
        messages = [{"role": "user", "content": prompt}]
    elif prompt is not None:
        raise RowError(
            f"{where}: 'prompt' must be a str or a chat list, got {type(prompt).__name__}"
        )
    else:
        raise RowError(f"{where} has no prompt or messages")

    if "ground_truth" in obj:
        ground_truth = obj["ground_truth"]
    elif isinstance(obj.get("reward_model"), Mapping) and "ground_truth" in obj["reward_model"]:
        ground_truth = obj["reward_model"]["ground_truth"]
    else:
        raise RowError(f"{where} has no ground_truth (use null if the reward needs none)")
    _json_safe(ground_truth, where, "ground_truth")

    data_source = obj.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        got = "missing" if data_source is None else repr(data_source)
        raise RowError(f"{where}: 'data_source' must be a non-empty str, got {got}")

    key = "extra" if _present(obj, "extra") else "extra_info"
    extra = _as_dict(obj[key], where, key) if _present(obj, key) else {}
    _json_safe(extra, where, key)
    return PromptRow(messages, ground_truth, data_source, extra, where)


def _decode(raw: bytes, where: str, first: bool) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowError(
            f"{where} is not UTF-8: byte {e.start} of the line is {raw[e.start : e.start + 1]!r} "
            f"({e.reason}); save the file as UTF-8"
        ) from None
    return text.removeprefix("\ufeff") if first else text


def _jsonl_rows(path: str) -> Iterator[tuple[int, Callable[[], Any], str]]:
    """``(bytes, decode, where)`` per non-blank line; a line is read at most
    ``ROW_LIMITS.max_bytes`` at a time and decoded only within ``ROW_LIMITS``
    (``creditrl.bounded_json``)."""
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(ROW_LIMITS.max_bytes + 1):
            number += 1
            where = f"row {number} of {path}"
            if len(raw) > ROW_LIMITS.max_bytes:
                raise RowError(f"{where} is longer than the limit of {ROW_LIMITS.max_bytes} bytes")
            line = _decode(raw, where, number == 1)
            if line.strip():
                yield len(raw), partial(_load_json, line, where), where


def _load_json(line: str, where: str) -> Any:
    try:
        return loads_bounded(line, ROW_LIMITS)
    except JsonLimitError as e:
        raise RowError(f"{where}: {e}") from None
    except json.JSONDecodeError as e:
        raise RowError(f"{where} is not valid JSON: {e.msg} (column {e.colno})") from None


def _parquet_rows(path: str) -> Iterator[tuple[int, Callable[[], Any], str]]:
    """``(decoded bytes, decode, where)`` per row (``creditrl.data.parquet``); a row over
    ``ROW_LIMITS.max_bytes`` decoded is refused before it is decoded."""
    from creditrl.data.parquet import iter_parquet

    for number, (nbytes, decode) in enumerate(iter_parquet(path), 1):
        where = f"row {number} of {path}"
        if nbytes > ROW_LIMITS.max_bytes:
            raise RowError(
                f"{where} holds {nbytes} bytes of values decoded, more than the limit of "
                f"{ROW_LIMITS.max_bytes} bytes"
            )
        yield nbytes, decode, where


_READERS = {".jsonl": _jsonl_rows, ".parquet": _parquet_rows}


def _check_path(path: str, key: str) -> None:
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _READERS:
        raise DataError(
            f"{key}: {path}: unsupported data file type {suffix!r}; use .jsonl or .parquet"
        )
    if not os.path.isfile(path):
        what = "is not a regular file" if os.path.exists(path) else "does not exist"
        raise DataError(f"{key}: {path} {what}")


def read_rows(
    path: str | os.PathLike[str], key: str = "data file", max_rows: int | None = None
) -> list[PromptRow]:
    """The first ``max_rows`` (None: all) rows of one ``.jsonl`` or ``.parquet`` file,
    validated; see ``read_rows_from_files``."""
    return read_rows_from_files([os.fspath(path)], key=key, max_rows=max_rows)


def read_rows_from_files(
    paths: list[str],
    system_prompt: str | None = None,
    key: str = "data file",
    max_rows: int | None = None,
    max_rows_key: str = "max_rows",
) -> list[PromptRow]:
    """The first ``max_rows`` rows (None: all) of several files: file by file in the order
    given, each file's rows in file order, so the rows and their order depend only on the files
    and ``max_rows`` (a resumed run gets the same rows). Reading stops there: later rows are
    neither decoded nor validated, and later files not opened (a warning names
    ``max_rows_key``). ``system_prompt`` is prepended to rows without one.

    Bounds, besides ``max_rows``: a row holds at most ``ROW_LIMITS.max_bytes`` (a jsonl line;
    a parquet row's values decoded, a dictionary-encoded value counted at each use) and all rows
    together ``MAX_TOTAL_BYTES``. A DataError (RowError for one row) names ``key`` (e.g.
    ``data.train_files``) or the file and row.
    """
    for path in paths:
        _check_path(path, key)
    rows: list[PromptRow] = []
    total = 0
    for number, path in enumerate(paths):
        before = len(rows)
        for nbytes, decode, where in _READERS[os.path.splitext(path)[1].lower()](path):
            if max_rows is not None and len(rows) >= max_rows:
                _warn_unread(key, max_rows_key, max_rows, f"{where} on")
                return _with_system(rows, system_prompt)
            total += nbytes
            if total > MAX_TOTAL_BYTES:
                raise DataError(
                    f"{key}: the rows up to {where} hold more than {MAX_TOTAL_BYTES} bytes; "
                    f"lower {max_rows_key} or shorten the rows"
                )
            rows.append(parse_row(decode(), where))
        if len(rows) == before:
            raise DataError(f"{key}: {path} has no rows")
        if max_rows is not None and len(rows) >= max_rows and number + 1 < len(paths):
            _warn_unread(key, max_rows_key, max_rows, ", ".join(paths[number + 1 :]))
            break
    return _with_system(rows, system_prompt)


def _warn_unread(key: str, max_rows_key: str, max_rows: int, unread: str) -> None:
    logger.warning(
        "%s: using the first %d rows (%s); not read: %s", key, max_rows, max_rows_key, unread
    )


def _with_system(rows: list[PromptRow], system_prompt: str | None) -> list[PromptRow]:
    if system_prompt is not None:
        for row in rows:
            if row.messages[0]["role"] != "system":
                row.messages.insert(0, {"role": "system", "content": system_prompt})
    return rows
