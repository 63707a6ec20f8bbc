"""Reading ``metrics.jsonl`` of a run, finished or still being written.

Each line is ``{"step", "time", **metrics}`` (creditrl.tracking.sinks.JsonlSink). A last line
without its newline is a record being written and is left out; any other unreadable line is
counted and left out, as is one over ``RUN_RECORD_LIMITS``. A step logged twice (a resumed
run) keeps its last record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from creditrl.bounded_json import RUN_RECORD_LIMITS, loads_bounded

__all__ = ["MetricsLog", "read_metrics"]


@dataclass
class MetricsLog:
    """Records by step (ascending), plus what was left out."""

    path: Path
    records: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    partial_last_line: bool = False

    def keys(self) -> list[str]:
        """Every metric name logged at least once, sorted."""
        return sorted({k for r in self.records for k in r if k not in ("step", "time")})

    def series(self, key: str) -> tuple[list[int], list[float | None]]:
        """(steps, values) of the records holding ``key``; null/NaN values stay as None."""
        steps, values = [], []
        for r in self.records:
            if key in r:
                v = r[key]
                ok = isinstance(v, int | float) and math.isfinite(float(v))
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
    """Parse ``path``; FileNotFoundError naming it when it does not exist."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is this a creditrl run directory?")
    text = path.read_text(encoding="utf-8")
    log = MetricsLog(path)
    lines = text.split("\n")
    by_step: dict[int, dict[str, Any]] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = loads_bounded(line, RUN_RECORD_LIMITS)
            step = int(row["step"])
        except (KeyError, TypeError, ValueError):
            if lineno == len(lines):
                log.partial_last_line = True
            else:
                log.bad_lines.append(lineno)
            continue
        by_step[step] = row
    log.records = [by_step[s] for s in sorted(by_step)]
    return log
