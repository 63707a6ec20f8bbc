"""The training loop's console view: a rich progress bar, and the end-of-run summary.

On a terminal the bar redraws in place; otherwise (logs, CI, pipes) each update prints one
line, e.g. ``step 3/10 | reward 0.500 | val 0.400 | resp_len 42.0 | 1.23 s/step | ...``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn
from rich.table import Table

from creditrl.plain_text import as_text

__all__ = ["KEY_METRICS", "TrainingProgress", "print_summary", "reward_trend"]

# (label, metric names tried in order; a name ending in "/" matches the first key with that
# prefix, in insertion order). The last value seen is kept: validation runs every few steps.
KEY_METRICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("critic/rewards/mean",)),
    ("score", ("critic/score/mean",)),
    ("val", ("val/score/mean", "val/score", "val-core/")),
    ("resp_len", ("response_length/mean",)),
    ("s/step", ("timing_s/step", "perf/time_per_step")),
)


def _duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-:--:--"
    return str(timedelta(seconds=round(seconds)))


def _lookup(metrics: Mapping[str, Any], names: Sequence[str]) -> float | None:
    for name in names:
        if name.endswith("/"):
            for key, value in metrics.items():
                if key.startswith(name):
                    return float(value)
        elif name in metrics:
            return float(metrics[name])
    return None


def _number(value: float) -> str:
    return f"{value:.4g}"


class TrainingProgress:
    """Step counter with elapsed time, ETA and key numbers (reward, val score, response length,
    step seconds), updated once per step by ``update(step, metrics)``.

    ETA = (elapsed / steps done since ``start_step``) * steps left. When ``console`` is not a
    terminal, each update prints one line instead of redrawing.
    """

    def __init__(self, total_steps: int, start_step: int, console: Console) -> None:
        self.total_steps = total_steps
        self.start_step = start_step
        self.console = console
        self.step = start_step
        self.shown: dict[str, float] = {}
        self._t0 = time.monotonic()
        self._progress: Progress | None = None
        self._task = 0
        if console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("step {task.completed}/{task.total}", markup=False),
                BarColumn(),
                TextColumn("{task.fields[times]}", markup=False),
                TextColumn("{task.fields[numbers]}", markup=False),
                console=console,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, times="", numbers=""
            )
            self._progress.start()

    def elapsed(self) -> float:
        """Seconds since this progress view was created."""
        return time.monotonic() - self._t0

    def eta(self) -> float:
        """Seconds left, from the mean time of the steps done so far (inf before the first)."""
        done = self.step - self.start_step
        if done <= 0:
            return math.inf
        return self.elapsed() / done * max(self.total_steps - self.step, 0)

    def line(self) -> str:
        """The key numbers as ``label value`` pairs joined by `` | ``."""
        return " | ".join(f"{label} {_number(v)}" for label, v in self.shown.items())

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record that ``step`` finished with ``metrics`` and refresh the view."""
        self.step = step
        for label, names in KEY_METRICS:
            value = _lookup(metrics, names)
            if value is not None:
                self.shown[label] = value
        times = f"elapsed {_duration(self.elapsed())} | eta {_duration(self.eta())}"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, times=times, numbers=self.line())
            return
        parts = [f"step {step}/{self.total_steps}", self.line(), times]
        self.console.print(as_text(" | ".join(p for p in parts if p)), soft_wrap=True)

    def close(self) -> None:
        """Stop redrawing (the bar stays on screen)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> TrainingProgress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def reward_trend(rewards: Sequence[float], k: int) -> tuple[float, float]:
    """(mean of the first ``k`` values, mean of the last ``k``); ValueError when empty."""
    if not rewards or k < 1:
        raise ValueError(f"reward_trend needs at least one value and k >= 1 (k={k})")
    k = min(k, len(rewards))
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def _fmt(value: Any) -> str:
    return "n/a" if value is None else _number(float(value))


def print_summary(console: Console, summary: Mapping[str, Any]) -> None:
    """Print the end-of-run summary.

    ``summary`` keys (all optional): ``val_score_before``, ``val_score_after`` (floats),
    ``rewards`` (per-step mean rewards), ``trend_k`` (default min(5, ceil(n/2))), ``steps``,
    ``total_time_s``, ``output_dir`` (lists metrics.jsonl, rollouts/, checkpoints/ in it).
    """
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    before, after = summary.get("val_score_before"), summary.get("val_score_after")
    if before is not None or after is not None:
        change = ""
        if before is not None and after is not None:
            change = f"  ({float(after) - float(before):+.4g})"
        table.add_row("validation score", f"{_fmt(before)} -> {_fmt(after)}{change}")
    rewards = [float(r) for r in summary.get("rewards", [])]
    if rewards:
        k = int(summary.get("trend_k", min(5, math.ceil(len(rewards) / 2))))
        first, last = reward_trend(rewards, k)
        k = min(k, len(rewards))
        table.add_row(
            "reward trend",
            f"first {k} steps {_fmt(first)} -> last {k} steps {_fmt(last)}  ({last - first:+.4g})",
        )
    if "steps" in summary:
        table.add_row("steps", str(summary["steps"]))
    if "total_time_s" in summary:
        table.add_row("total time", _duration(float(summary["total_time_s"])))
    if summary.get("output_dir") is not None:
        out = Path(summary["output_dir"])
        for label, name in (
            ("metrics", "metrics.jsonl"),
            ("rollouts", "rollouts/"),
            ("checkpoints", "checkpoints/"),
        ):
            path = out / name
            note = "" if path.exists() else "  (not written)"
            table.add_row(label, as_text(f"{path}{'/' if name.endswith('/') else ''}{note}"))
    console.print(Panel(table, title="run summary", expand=False))
