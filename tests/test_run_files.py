"""A run's own JSONL files read back (report, explain, resume) are bounded before decoding: a
line nested 100,000 deep (a RecursionError before) or over the byte limit is left out or named
in one line, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from creditrl.bounded_json import JsonLimits
from creditrl.inspect.from_run import step_metrics
from creditrl.report.metrics_log import read_metrics
from creditrl.tracking import rollout_dump
from creditrl.tracking.rollout_dump import load_rollout_dump
from creditrl.tracking.sinks import truncate_jsonl

DEEP = '{"step": 2, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
GOOD = [json.dumps({"step": 1, "time": 0.5, "a": 1.0}), json.dumps({"step": 3, "a": 2.0})]


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_report_leaves_a_deep_line_out(tmp_path: Path) -> None:
    log = read_metrics(write(tmp_path / "metrics.jsonl", [GOOD[0], DEEP, GOOD[1]]))
    assert [r["step"] for r in log.records] == [1, 3] and log.bad_lines == [2]


def test_explain_skips_a_deep_metrics_line(tmp_path: Path) -> None:
    write(tmp_path / "metrics.jsonl", [GOOD[0], DEEP, GOOD[1]])
    assert step_metrics(tmp_path, 2) == {} and step_metrics(tmp_path, 3)["a"] == 2.0


def test_resume_drops_a_deep_line(tmp_path: Path) -> None:
    path = write(tmp_path / "metrics.jsonl", [GOOD[0], DEEP, GOOD[1]])
    assert truncate_jsonl(path, 5) == 1
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]


def test_a_dumped_rollout_line_over_a_limit_is_named(tmp_path: Path, monkeypatch) -> None:
    path = write(tmp_path / "step_000001.jsonl", ['{"row": 0}', DEEP])
    with pytest.raises(ValueError, match=r"step_000001\.jsonl line 2 is too large: nested"):
        load_rollout_dump(path)
    monkeypatch.setattr(rollout_dump, "RUN_RECORD_LIMITS", JsonLimits(max_bytes=8))
    with pytest.raises(ValueError, match=r"line 1 is too large: 11 bytes, above the limit of 8"):
        load_rollout_dump(path)
