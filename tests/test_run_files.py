"""A run's own JSONL files read back (report, explain, resume) are bounded before decoding: a
line nested 100,000 deep (a RecursionError before) or over the byte limit is left out or named
in one line, never a traceback. Every file report, explain, eval and export read from a run
gets a run file's checks (``creditrl.config.run_files``): a FIFO or a device is one line naming
it, never a hang; a line over its limit is counted and said, never read whole."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import tracemalloc
from pathlib import Path

import pytest

from creditrl.bounded_json import RUN_RECORD_LIMITS, JsonLimits
from creditrl.cli import main
from creditrl.config.run_files import DUMP_LINES, LineLimits, run_file_lines
from creditrl.errors import DataError
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
    with pytest.raises(ValueError, match=r"line 1 is too large: 10 bytes, above the limit of 8"):
        load_rollout_dump(path)


# ---- every file report, explain, eval and export read from a run gets the run-file checks ----


def within(seconds: float, fn, *args, fifo: Path | None = None):
    """``fn(*args)`` on a thread, failing the test if it has not returned after ``seconds`` (a
    reader that opened the FIFO ``fifo`` with a blocking open is let go first)."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["value"] = fn(*args)
        except BaseException as err:  # handed to the test's thread
            result["error"] = err

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if fifo is not None:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{getattr(fn, '__name__', fn)} still reading after {seconds} s: it hangs")
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["value"]


def one_line(capsys: pytest.CaptureFixture[str]) -> str:
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert "Traceback" not in text
    return text


def test_explain_of_a_fifo_rollout_dump_is_one_line_not_a_hang(tmp_path: Path, capsys) -> None:
    """`creditrl explain RUN --step 1 --row 0` hung for good when the dump was a FIFO."""
    dump = tmp_path / "rollouts" / "step_000001.jsonl"
    dump.parent.mkdir()
    os.mkfifo(dump)
    argv = ["explain", str(tmp_path), "--step", "1", "--row", "0"]
    assert within(60, main, argv, fifo=dump) == 2
    assert f"{dump} is a FIFO, not a regular file" in one_line(capsys)
    with pytest.raises(DataError, match="is a FIFO, not a regular file"):
        within(60, load_rollout_dump, dump, fifo=dump)


def test_report_of_a_fifo_or_a_device_metrics_file_says_what_it_is(tmp_path: Path, capsys) -> None:
    """`creditrl report` said a FIFO metrics.jsonl "does not exist"."""
    metrics = tmp_path / "metrics.jsonl"
    os.mkfifo(metrics)
    assert within(60, main, ["report", str(tmp_path), "--no-png"], fifo=metrics) == 2
    said = one_line(capsys)
    assert said.startswith("error: ") and f"{metrics} is a FIFO, not a regular file" in said
    with pytest.raises(DataError, match="is a FIFO, not a regular file"):
        within(60, step_metrics, tmp_path, 1, fifo=metrics)  # explain's read of it
    metrics.unlink()
    metrics.symlink_to("/dev/zero")
    assert within(60, main, ["report", str(tmp_path), "--no-png"]) == 2
    assert f"{metrics}: a link to /dev/zero, outside the run directory" in one_line(capsys)


def test_an_oversized_metrics_line_is_counted_and_said_never_read_whole(
    tmp_path: Path, capsys
) -> None:
    """A 300 MB single-line metrics.jsonl cost `creditrl report` 920 MB and was left out
    without a word. A line over the 1 MiB line limit is now skipped in chunks (never held),
    counted and said; a file over the 256 MiB file limit is refused before it is read."""
    metrics = tmp_path / "metrics.jsonl"
    write(metrics, [GOOD[0], json.dumps({"step": 2, "a": 9.0, "pad": "x" * (32 << 20)}), GOOD[1]])
    tracemalloc.start()
    try:
        log = read_metrics(metrics)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"held {peak} bytes reading a 32 MiB line"  # a few 1 MiB chunks
    assert [r["step"] for r in log.records] == [1, 3] and log.long_lines == [2]
    assert step_metrics(tmp_path, 3)["a"] == 2.0
    notes: list[str] = []
    assert step_metrics(tmp_path, 2, notes) == {} and "1 lines over the limit" in notes[0]
    assert main(["report", str(tmp_path), "--no-png"]) == 0
    said = one_line(capsys)
    assert "1 lines over the limit of 1048576 bytes left out unread: [2]" in said
    with metrics.open("r+b") as f:  # 300 MB, sparse: nothing written past the first lines
        f.truncate(300 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"314572800 bytes, above the limit of 268435456"):
            read_metrics(metrics)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert main(["report", str(tmp_path), "--no-png"]) == 2
    assert "above the limit of 268435456 bytes (256 MiB)" in one_line(capsys)


def test_line_and_line_count_limits_of_a_run_file(tmp_path: Path) -> None:
    path = write(tmp_path / "f.jsonl", ["a" * 10, "b" * 11, "", "c"])
    limits = LineLimits(max_bytes=100, max_line_bytes=10, max_lines=4)
    lines = list(run_file_lines(path, limits))
    assert [(n, d, e) for n, d, e in lines] == [
        (1, b"a" * 10, True),
        (2, None, True),
        (3, b"", True),
        (4, b"c", True),
    ]
    with pytest.raises(DataError, match=r"f\.jsonl: more than 3 lines, above the limit"):
        list(run_file_lines(path, LineLimits(100, 10, 3)))
    with pytest.raises(DataError, match=r"f\.jsonl: 26 bytes, above the limit of 25 bytes"):
        list(run_file_lines(path, LineLimits(25, 10, 4)))
    assert DUMP_LINES.max_line_bytes == RUN_RECORD_LIMITS.max_bytes
