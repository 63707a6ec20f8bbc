"""How well the untrained embedded model does on candidate tasks: greedy validation accuracy.

Run: .venv/bin/python benchmarks/task_difficulty.py [--val-size N] [NAME ...]

Each candidate is a task, its difficulty and the number of worked examples; the script runs
creditrl's own validation (greedy answers to N held-out prompts, the run's scorer) with the
embedded SmolLM2-135M-Instruct and prints per candidate: val/score, strict accuracy (a correct
answer inside <answer> tags) and the share of tagged answers (the format is known when that is
near 1, so a run on that task teaches the task, not the tags). The presets' tasks were chosen
with it (docs/recipe.md, "Tasks the model cannot do yet").
"""

from __future__ import annotations

import argparse
import json
import time

from creditrl.config.loader import load_config
from creditrl.exporting.evaluate import validation_metrics

CANDIDATES: dict[str, list[str]] = {
    "chain_sum_2x1": ["data.task=chain_sum", "data.few_shot=2"],
    "chain_sum_2x2": [
        "data.task=chain_sum", "data.few_shot=2",
        "data.task_kwargs={min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}",
    ],
    "chain_sum_3x2": [
        "data.task=chain_sum", "data.few_shot=2",
        "data.task_kwargs={min_terms: 3, max_terms: 3, min_digits: 2, max_digits: 2}",
    ],
    "chain_sum_2x3": [
        "data.task=chain_sum", "data.few_shot=2",
        "data.task_kwargs={min_terms: 2, max_terms: 2, min_digits: 3, max_digits: 3}",
    ],
    "products_2x1": [
        "data.task=products", "data.few_shot=2",
        "data.task_kwargs={min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 1}",
    ],
    "products_2x2": [
        "data.task=products", "data.few_shot=2",
        "data.task_kwargs={min_terms: 2, max_terms: 2, min_digits: 2, max_digits: 2}",
    ],
    "products_2x3": [
        "data.task=products", "data.few_shot=2",
        "data.task_kwargs={min_terms: 2, max_terms: 2, min_digits: 3, max_digits: 3}",
    ],
    "basic_arithmetic": [
        "data.task=basic_arithmetic", "data.few_shot=2",
        "data.task_kwargs={min_terms: 2, max_terms: 3, min_digits: 1, max_digits: 2}",
    ],
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--val-size", type=int, default=64)
    parser.add_argument("names", nargs="*", help=f"candidates (default: all of {list(CANDIDATES)})")
    args = parser.parse_args()
    for name in args.names or list(CANDIDATES):
        overrides = [*CANDIDATES[name], f"data.val_size={args.val_size}", "data.train_size=64"]
        start = time.perf_counter()
        metrics = validation_metrics(load_config(overrides=overrides))
        row = {
            "candidate": name,
            "score": round(metrics["val/score"], 4),
            "strict_accuracy": round(metrics.get("val/strict_accuracy", float("nan")), 4),
            "seconds": round(time.perf_counter() - start, 1),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
