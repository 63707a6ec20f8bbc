"""On-policy context distillation vs the outcome reward alone: validation score by wall clock
and by step, on the same prompts, for the same minutes.

Run: .venv/bin/python benchmarks/distill_curve.py [--minutes 16] [--out DIR] [key=value ...]

Both arms start from ``preset=distill_context`` (the embedded SmolLM2-135M-Instruct, chain_sum
questions without a worked example, the same data seed and so the same prompts in the same
order) plus the overrides, and differ in one thing:

- ``distill``: the preset: the teacher is the same initial model with one worked example in its
  prompt; the pure distillation loss (``actor.policy_loss=distill``) on the student's samples;
- ``outcome``: ``distill.teacher=null actor.policy_loss=ppo``: GRPO on the task's outcome
  reward, the rest unchanged.

The two arms run at the same time as two processes with one torch thread each, so they share
the machine equally (other work on it slows both); both are stopped ``--minutes`` after they
were started (model loading counted) and every validation logged by then is a point. The
wall-clock time of a point is when its metrics line was written, from the common start.

Writes ``benchmarks/results/distill_curve.json``, ``.md`` and ``.png``; the runs' directories
go under ``--out`` (default /tmp/creditrl_distill_curve).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from creditrl.report.metrics_log import read_metrics

RESULTS = Path(__file__).parent / "results"
COMMON = [
    "preset=distill_context",
    "trainer.total_steps=100000",
    "trainer.test_freq=2",
    "trainer.save_freq=0",
    "trainer.num_threads=1",
    "trainer.logger=[jsonl]",
    "data.val_size=24",
    "data.train_batch_size=2",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=2",
]
ARMS = {
    "distill": [],
    "outcome": ["distill.teacher=null", "actor.policy_loss=ppo"],
}


def curve(out: Path, start: float, seconds: float) -> list[dict]:
    """The validations of a run logged within ``seconds`` of ``start``."""
    points = []
    path = out / "metrics.jsonl"
    for row in read_metrics(path).records if path.is_file() else []:
        wall = row.get("time", 0.0) - start
        if "val/score" in row and wall <= seconds:
            points.append(
                {
                    "step": row["step"],
                    "wall_s": round(wall, 1),
                    "val_score": row["val/score"],
                    "val_strict_accuracy": row.get("val/strict_accuracy"),
                }
            )
    return points


def run(minutes: float, root: Path, extra: list[str]) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    procs, loads = {}, []
    start = time.time()
    for arm, overrides in ARMS.items():
        args = [*COMMON, *overrides, *extra, f"trainer.output_dir={root / arm}"]
        log = (root / f"{arm}.log").open("w")
        procs[arm] = subprocess.Popen(
            [sys.executable, "-m", "creditrl.cli", "train", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    while time.time() - start < minutes * 60 and any(p.poll() is None for p in procs.values()):
        loads.append(os.getloadavg()[0])
        time.sleep(10)
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs.values():
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
    seconds = minutes * 60
    return {
        "minutes": minutes,
        "settings": [*COMMON, *extra],
        "arms": {
            arm: {"overrides": ARMS[arm], "curve": curve(root / arm, start, seconds)}
            for arm in ARMS
        },
        "load_average_mean": round(sum(loads) / max(len(loads), 1), 2),
        "cpus": os.cpu_count(),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, data in result["arms"].items():
        points = data["curve"]
        label = {"distill": "distillation (teacher sees the example)", "outcome": "outcome reward"}
        by_time.plot([p["wall_s"] / 60 for p in points], [p["val_score"] for p in points],
                     marker="o", label=label[arm])  # fmt: skip
        by_step.plot([p["step"] for p in points], [p["val_score"] for p in points], marker="o",
                     label=label[arm])  # fmt: skip
    by_time.set_xlabel("wall clock (minutes, both arms at once)")
    by_step.set_xlabel("step")
    for ax in (by_time, by_step):
        ax.set_ylabel("val/score (no worked example)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("preset=distill_context: SmolLM2-135M-Instruct on chain_sum, CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def markdown(result: dict) -> str:
    lines = [
        "# On-policy context distillation vs the outcome reward",
        "",
        "`benchmarks/distill_curve.py`: `preset=distill_context` (the embedded "
        "SmolLM2-135M-Instruct on chain_sum questions without a worked example) with "
        f"`{' '.join(result['settings'][1:])}`; the arms ran at the same time, one torch "
        f"thread each, for {result['minutes']} minutes on a {result['cpus']}-core CPU whose "
        f"1-minute load average was {result['load_average_mean']} on average (other work "
        "shared the machine). Validation: greedy, 24 held-out questions without the example. "
        "val/score is the chain_sum reward: 1 per correct answer inside <answer> tags, 0.5 per "
        "correct answer in plain text (its last number), +0.1 for the tags; "
        "val/strict_accuracy is the share answered correctly inside the tags.",
        "",
        "| arm | step | minutes | val/score | val/strict_accuracy |",
        "|---|---|---|---|---|",
    ]
    for arm, data in result["arms"].items():
        for p in data["curve"]:
            lines.append(
                f"| {arm} | {p['step']} | {p['wall_s'] / 60:.1f} | {p['val_score']:.3f} | "
                f"{p['val_strict_accuracy']} |"
            )
    lines += ["", "![curves](distill_curve.png)", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=16.0)
    parser.add_argument("--out", type=Path, default=Path("/tmp/creditrl_distill_curve"))
    args, extra = parser.parse_known_args()
    result = run(args.minutes, args.out, extra)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "distill_curve.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "distill_curve.md").write_text(markdown(result))
    plot(result, RESULTS / "distill_curve.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
