"""Score before and after, and minutes, of a tinker-cookbook run against ``creditrl serve-tinker``.

Reads the recipe's own ``LOG_PATH/metrics.jsonl`` (one line per step) and prints, for each
``--key``, the first ``--window`` steps' mean, the last ``--window`` steps' mean, and the wall
minutes from the first to the last line (plus the first step's own time)::

    python benchmarks/tinker_scores.py /tmp/rl env/all/correct env/all/reward/total
    python benchmarks/tinker_scores.py /tmp/sl train_mean_nll --window 3

The runs themselves and their commands: benchmarks/results/tinker_recipes.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_steps(log_path: Path) -> list[dict]:
    """The recipe's metrics lines, in order."""
    lines = (log_path / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def summary(steps: list[dict], key: str, window: int) -> str:
    """``key: first-window mean -> last-window mean (steps)``."""
    values = [s[key] for s in steps if isinstance(s.get(key), int | float)]
    if not values:
        return f"{key}: not logged"
    first = sum(values[:window]) / len(values[:window])
    last = sum(values[-window:]) / len(values[-window:])
    return f"{key}: {first:.3f} -> {last:.3f} (mean of first/last {window} of {len(values)} steps)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log_path", type=Path)
    parser.add_argument("keys", nargs="+")
    parser.add_argument("--window", type=int, default=2)
    args = parser.parse_args()
    steps = read_steps(args.log_path)
    for key in args.keys:
        print(summary(steps, key, args.window))
    total = sum(s.get("time/total", s.get("time/step", 0.0)) or 0.0 for s in steps)
    print(f"steps: {len(steps)}, summed step time {total / 60:.1f} min")


if __name__ == "__main__":
    main()
