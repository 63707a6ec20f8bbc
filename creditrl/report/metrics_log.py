"""Reading ``metrics.jsonl`` of a run, finished or still being written.

Each line is ``{"step", "time", **metrics}`` (creditrl.tracking.sinks.JsonlSink). A last line
without its newline is a record being written and is left out; any other unreadable line is
counted and left out, as is one over ``RUN_RECORD_LIMITS``. A step logged twice (a resumed
run) keeps its last record. The file gets a run file's checks and bounds
(``creditrl.config.run_files``, ``METRICS_LINES``): a FIFO, a link outside the run or a file
too large is one ``DataError`` line; a line over the line limit is never read into memory,
only counted (``long_lines``) and said.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from creditrl.bounded_json import RUN_RECORD_LIMITS, loads_bounded
from creditrl.config.run_files import METRICS_LINES, run_file_lines

__all__ = ["MetricsLog", "read_metrics"]


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


@dataclass
class MetricsLog:
    """Records by step (ascending), plus what was left out."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    long_lines: list[int] = field(default_factory=list)
    partial_last_line: bool = False

    def left_out(self) -> list[str]:
        """What was left out, one sentence each (for the page and the command's notes)."""
        said = []
        if self.long_lines:
            said.append(
                f"{len(self.long_lines)} lines over the limit of "
                f"{METRICS_LINES.max_line_bytes} bytes left out unread: {self.long_lines[:20]}"
            )
        if self.bad_lines:
            said.append(f"unreadable lines left out: {self.bad_lines[:20]}")
        return said

    def keys(self) -> list[str]:
        """Every metric name logged at least once, sorted."""
        return sorted({k for r in self.records for k in r if k not in ("step", "time")})

    def series(self, key: str) -> tuple[list[int], list[float | None]]:
        """(steps, values) of the records holding ``key``; null/NaN values stay as None."""
        steps, values = [], []
        for r in self.records:
            if key in r:
                v = r[key]
                ok = isinstance(v, int | float) and _finite(v)
                steps.append(int(r["step"]))
                values.append(float(v) if ok else None)
        return steps, values

    @property
    def last_step(self) -> int | None:
        return self.records[-1]["step"] if self.records else None

    @property
    def last_time(self) -> float | None:
        times = [r["time"] for r in self.records if isinstance(r.get("time"), int | float)]
        return max(times) if times else None


def read_metrics(path: str | Path) -> MetricsLog:
    """Parse ``path``; FileNotFoundError naming it when it does not exist, a one-line
    ``DataError`` when it is no regular file inside its run or is over ``METRICS_LINES``."""
    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} does not exist: is this a creditrl run directory?")
    log = MetricsLog(path)
    by_step: dict[int, dict[str, Any]] = {}
    for line in run_file_lines(path, METRICS_LINES):
        if line.data is None:
            log.long_lines.append(line.number)
            continue
        if not line.data.strip():
            continue
        try:
            row = loads_bounded(line.data, RUN_RECORD_LIMITS)
            step = int(row["step"])
        except (KeyError, TypeError, ValueError, OverflowError):
            if not line.ended:
                log.partial_last_line = True
            else:
                log.bad_lines.append(line.number)
            continue
        by_step[step] = row
    log.records = [by_step[s] for s in sorted(by_step)]
    return log
