"""The default run's learning curve: reward and validation score by step, as CSV and PNG.

Run: .venv/bin/python benchmarks/learning_curve.py [--run-dir DIR] [--trl-steps N] [key=value ...]

Without --run-dir it first trains the default config (what `make run` does) into
runs/learning_curve; with it, it reads that run's metrics.jsonl. Writes learning_curve.csv and
learning_curve.png into the run directory and prints: validation score before -> after, the
reward's mean over the first and last five steps, and the step-to-step noise (std of the
reward's step differences / sqrt 2). With --trl-steps N (needs the `bench` extra) it also runs
TRL's GRPOTrainer for N steps on the same task and shape and plots both against wall time.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_default(run_dir: Path, overrides: list[str]) -> None:
    from creditrl.cli import main as cli_main

    code = cli_main(["train", f"trainer.output_dir={run_dir}", *overrides])
    if code != 0:
        raise SystemExit(code)


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "elapsed_s", "reward_mean", "val_score"])
        for r in rows:
            writer.writerow([r["step"], r["elapsed_s"], r.get("reward"), r.get("val")])


def plot(rows: list[dict], trl: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r for r in rows if r.get("reward") is not None]
    vals = [r for r in rows if r.get("val") is not None]
    by_step.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="reward (mean)")
    by_step.plot([r["step"] for r in vals], [r["val"] for r in vals], "o-", label="val score")
    by_step.set_xlabel("step")
    by_step.set_title("creditrl default run")
    by_step.legend()
    by_time.plot(
        [r["elapsed_s"] / 60 for r in steps], [r["reward"] for r in steps], label="creditrl"
    )
    if trl:
        minutes = [t / 60 for t in trl["ended_s"][: len(trl["rewards"])]]
        by_time.plot(minutes, trl["rewards"], label="TRL GRPOTrainer")
    by_time.set_xlabel("wall time (min)")
    by_time.set_ylabel("reward (mean)")
    by_time.set_title("reward at equal wall time")
    by_time.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("--trl-steps", type=int, default=0)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run_dir = args.run_dir or Path("runs/learning_curve")
    if args.run_dir is None:
        train_default(run_dir, args.overrides)
    metrics = read_metrics(run_dir)
    start = next((m["time"] for m in metrics if m["step"] == 1), metrics[0]["time"])
    first_step_s = next((m.get("timing_s/step", 0.0) for m in metrics if m["step"] == 1), 0.0)
    rows = [
        {
            "step": m["step"],
            "elapsed_s": max(m["time"] - start + first_step_s, 0.0) if m["step"] else 0.0,
            "reward": m.get("critic/score/mean"),
            "val": m.get("val/score"),
        }
        for m in metrics
    ]
    trl = None
    if args.trl_steps:
        script = Path(__file__).with_name("trl_grpo.py")
        proc = subprocess.run(
            [sys.executable, str(script), "--steps", str(args.trl_steps)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        trl = json.loads(proc.stdout.strip().splitlines()[-1])
        (run_dir / "trl_grpo.json").write_text(json.dumps(trl))
    write_csv(rows, run_dir / "learning_curve.csv")
    plot(rows, trl, run_dir / "learning_curve.png")
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    vals = [r["val"] for r in rows if r["val"] is not None]
    diffs = [b - a for a, b in itertools.pairwise(rewards)]
    noise = statistics.pstdev(diffs) / 2**0.5 if len(diffs) > 1 else float("nan")
    print(f"run: {run_dir} ({len(rewards)} steps, {rows[-1]['elapsed_s'] / 60:.1f} min)")
    if len(vals) >= 2:
        print(f"validation score: {vals[0]:.3f} -> {vals[-1]:.3f} (gain {vals[-1] - vals[0]:+.3f})")
    k = min(5, len(rewards))
    print(
        f"reward: first {k} steps {statistics.mean(rewards[:k]):.3f}, last {k} steps "
        f"{statistics.mean(rewards[-k:]):.3f}; step-to-step noise {noise:.3f}"
    )
    if trl:
        for lo, hi in ((0, 10), (10, 20)):
            ours = [r["reward"] for r in rows if r["reward"] is not None and lo < r["step"] <= hi]
            theirs = trl["rewards"][lo:hi]
            if ours and theirs:
                print(
                    f"steps {lo + 1}-{hi}: creditrl {statistics.mean(ours):.3f}, "
                    f"TRL {statistics.mean(theirs):.3f}"
                )
    print(f"wrote {run_dir / 'learning_curve.csv'} and {run_dir / 'learning_curve.png'}")


if __name__ == "__main__":
    main()
