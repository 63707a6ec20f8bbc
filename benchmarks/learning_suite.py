"""Learning per minute: the default task, the tool task and the low-start task, creditrl and TRL.

Run: .venv/bin/python benchmarks/learning_suite.py [--tasks NAME ...] [--no-trl] [--reuse]

For each task it trains creditrl (``creditrl train [preset=...]`` into runs/suite/NAME, with a
validation every few steps), then TRL's GRPOTrainer (``trl_grpo.py``, needs the `bench` extra)
on the same config (prompts, group size, prompts per step, response budget, learning rate,
temperature, reward) for as many minutes of training as creditrl took, validating greedily on
the same held-out prompts. Training time is the sum of step times (validation excluded from
both clocks). The tool task has no TRL run: it would need TRL's own tool-calling path set up
for SmolLM2-135M, whose chat template renders no tool calls (not attempted).

Writes benchmarks/results/learning_suite.{json,md,png}: per task the validation metric against
training minutes for both, the minutes each needs to reach the task's stated score (">M" when
it did not within its M minutes), and whether creditrl is at or above TRL at every validation
time of either run; the machine's CPU flags head the table. ``--reuse`` rebuilds the files from
the run directories and TRL reports already there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from learning_curve import compare, read_metrics
from machine import cpu_flags

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@dataclass(frozen=True)
class Task:
    """One task of the suite: its preset (None: the default run), the validation metric, the
    score whose reaching is timed, and whether TRL runs it."""

    preset: str | None
    metric: str
    target: float
    test_freq: int
    trl_val_every: int
    trl: bool = True


TASKS = {
    "default": Task(None, "val/score", 0.9, 2, 3),
    "calculator_hard": Task("calculator_hard", "val/score", 0.6, 1, 0, trl=False),
    "arithmetic_hard": Task("arithmetic_hard", "val/strict_accuracy", 0.394, 10, 3),
}
TRL_METRIC = {"val/score": "score", "val/strict_accuracy": "strict_accuracy"}


def ours(name: str, task: Task, reuse: bool) -> list[tuple[float, float]]:
    """(training seconds, metric) of creditrl's validations on ``task``."""
    run_dir = ROOT / "runs" / "suite" / name
    if not reuse:
        preset = [f"preset={task.preset}"] if task.preset else []
        command = [sys.executable, "-m", "creditrl.cli", "train", *preset,
                   f"trainer.output_dir={run_dir}", f"trainer.test_freq={task.test_freq}",
                   "trainer.save_freq=0"]  # fmt: skip
        subprocess.run(command, check=True, cwd=ROOT)
    points, train_s = [], 0.0
    for m in read_metrics(run_dir):
        train_s += m.get("timing_s/step", 0.0)
        if task.metric in m:
            points.append((train_s, float(m[task.metric])))
    return points


def theirs(name: str, task: Task, minutes: float, reuse: bool) -> list[tuple[float, float]]:
    """(training seconds, metric) of TRL's validations on ``task`` for ``minutes``."""
    report = ROOT / "runs" / "suite" / f"{name}_trl.json"
    if not reuse:
        preset = ["--preset", task.preset] if task.preset else []
        command = [sys.executable, str(Path(__file__).with_name("trl_grpo.py")), *preset,
                   "--steps", "100000", "--minutes", f"{minutes:.2f}",
                   "--val-every", str(task.trl_val_every)]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
        report.write_text(proc.stdout.strip().splitlines()[-1])
    key = TRL_METRIC[task.metric]
    return [(v["train_s"], float(v[key])) for v in json.loads(report.read_text())["validations"]]


def minutes_to(points: list[tuple[float, float]], target: float) -> str:
    """Training minutes at the first validation reaching ``target`` (">M" if none did)."""
    for t, value in points:
        if value >= target:
            return f"{t / 60:.1f}"
    return f">{points[-1][0] / 60:.1f}"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items(), strict=True):
        for label, color in (("creditrl", "C0"), ("TRL", "C3")):
            points = result.get(label)
            if points:
                ax.plot([t / 60 for t, _ in points], [v for _, v in points], "o-",
                        color=color, label=label)  # fmt: skip
        ax.axhline(result["target"], color="grey", linestyle=":", label="stated score")
        ax.set_title(name)
        ax.set_xlabel("training minutes (validation excluded)")
        ax.set_ylabel(result["metric"])
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict, flags: str) -> str:
    lines = [
        "# Learning per minute (benchmarks/learning_suite.py)",
        "",
        f"CPU: {flags}",
        "",
        "| task | metric | creditrl start -> end (min) | TRL start -> end (min) | stated score "
        "| creditrl min to it | TRL min to it | creditrl >= TRL at every time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        a, b = r["creditrl"], r.get("TRL")

        def span(points):
            return f"{points[0][1]:.3f} -> {points[-1][1]:.3f} ({points[-1][0] / 60:.1f})"

        cells = [name, f"`{r['metric']}`", span(a), span(b) if b else "not run",
                 f"{r['target']:.3f}", minutes_to(a, r["target"]),
                 minutes_to(b, r["target"]) if b else "-",
                 str(compare(a, b)) if b else "-"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", nargs="*", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument("--reuse", action="store_true")
    args = parser.parse_args()
    (ROOT / "runs" / "suite").mkdir(parents=True, exist_ok=True)
    saved = RESULTS / "learning_suite.json"
    results = json.loads(saved.read_text())["tasks"] if saved.exists() else {}
    for name in args.tasks:
        task = TASKS[name]
        result = {"metric": task.metric, "target": task.target}
        result["creditrl"] = ours(name, task, args.reuse)
        if task.trl and not args.no_trl:
            minutes = result["creditrl"][-1][0] / 60
            result["TRL"] = theirs(name, task, minutes, args.reuse)
        results[name] = result
        print(name, json.dumps(result), flush=True)
    flags = cpu_flags()
    saved.write_text(json.dumps({"cpu": flags, "tasks": results}, indent=1))
    (RESULTS / "learning_suite.md").write_text(table(results, flags))
    plot(results, RESULTS / "learning_suite.png")
    print(table(results, flags))


if __name__ == "__main__":
    main()
