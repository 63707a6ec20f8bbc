"""The default run's learning curve against TRL's: validation score and reward by training time.

Run: .venv/bin/python benchmarks/learning_curve.py [--run-dir DIR] [--trl-minutes M] [key=value ...]

Without --run-dir it first trains the default config (what `make run` does) into
runs/learning_curve; with it, it reads that run's metrics.jsonl. Writes learning_curve.csv and
learning_curve.png into the run directory and prints: validation score before -> after, the
reward's mean over the first and last five steps, and the step-to-step noise (std of the
reward's step differences / sqrt 2). With --trl-minutes M (needs the `bench` extra) it also runs
TRL's GRPOTrainer (``trl_grpo.py``) for M minutes of training time on the same task, prompts,
shape, learning rate and temperature, validating greedily on the same held-out prompts every
``--trl-val-every`` steps, and plots both against training time (the sum of step times:
validation is kept out of both clocks). ``--trl-json FILE`` reuses an earlier TRL run's output.
It prints each side's validation score at the other's validation times (the latest validation
at or before that time) and whether ours is above TRL's at every one of them.
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


def write_csv(rows: list[dict], trl: dict | None, path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["run", "step", "train_s", "reward_mean", "val_score", "val_strict"])
        for r in rows:
            writer.writerow(
                [
                    "creditrl",
                    r["step"],
                    r["elapsed_s"],
                    r.get("reward"),
                    r.get("val"),
                    r.get("strict"),
                ]
            )
        if trl:
            for step, (t, reward) in enumerate(
                zip(trl["train_s"], trl["rewards"], strict=False), start=1
            ):
                writer.writerow(["trl", step, t, reward, None, None])
            for v in trl.get("validations", []):
                writer.writerow(
                    ["trl", v["step"], v["train_s"], None, v["score"], v["strict_accuracy"]]
                )


def at_or_before(points: list[tuple[float, float]], t: float) -> float | None:
    """The value of the latest (time, value) point at or before ``t``."""
    seen = [v for time_s, v in points if time_s <= t + 1e-9]
    return seen[-1] if seen else None


def compare(ours: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> bool:
    """Print both validation scores at every validation time of either run (within both
    runs' spans) and return whether ours is at least TRL's at every such time after 0."""
    end = min(ours[-1][0], theirs[-1][0])
    times = sorted({t for t, _ in ours + theirs if 0 < t <= end})
    above = True
    for t in times:
        a, b = at_or_before(ours, t), at_or_before(theirs, t)
        print(f"  {t / 60:5.1f} min: creditrl {a:.3f}  TRL {b:.3f}")
        above &= a >= b
    return above


def plot(rows: list[dict], trl: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r for r in rows if r.get("reward") is not None]
    vals = [r for r in rows if r.get("val") is not None]
    by_step.plot([r["step"] for r in steps], [r["reward"] for r in steps], label="reward (mean)")
    by_step.plot([r["step"] for r in vals], [r["val"] for r in vals], "o-", label="val score")
    stricts = [r for r in vals if r.get("strict") is not None]
    by_step.plot(
        [r["step"] for r in stricts], [r["strict"] for r in stricts], "s--", label="val strict acc."
    )
    by_step.set_xlabel("step")
    by_step.set_title("creditrl default run")
    by_step.legend()
    minutes = [r["elapsed_s"] / 60 for r in vals]
    by_time.plot(minutes, [r["val"] for r in vals], "o-", color="C0", label="creditrl val score")
    by_time.plot(
        [r["elapsed_s"] / 60 for r in steps],
        [r["reward"] for r in steps],
        color="C0",
        alpha=0.3,
        label="creditrl reward",
    )
    if trl:
        trl_vals = trl.get("validations", [])
        by_time.plot(
            [v["train_s"] / 60 for v in trl_vals],
            [v["score"] for v in trl_vals],
            "o-",
            color="C3",
            label="TRL val score",
        )
        minutes = [t / 60 for t in trl["train_s"][: len(trl["rewards"])]]
        by_time.plot(minutes, trl["rewards"], color="C3", alpha=0.3, label="TRL reward")
    by_time.set_xlabel("training time (min; validation excluded)")
    by_time.set_ylabel("score")
    by_time.set_title("creditrl vs TRL GRPOTrainer at equal training time")
    by_time.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--run-dir", type=Path)
    parser.add_argument("--trl-minutes", type=float, default=0.0)
    parser.add_argument("--trl-val-every", type=int, default=3)
    parser.add_argument("--trl-json", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run_dir = args.run_dir or Path("runs/learning_curve")
    if args.run_dir is None:
        train_default(run_dir, args.overrides)
    metrics = read_metrics(run_dir)
    rows, train_s = [], 0.0
    for m in metrics:
        train_s += m.get("timing_s/step", 0.0)
        rows.append(
            {
                "step": m["step"],
                "elapsed_s": train_s,
                "reward": m.get("critic/score/mean"),
                "val": m.get("val/score"),
                "strict": m.get("val/strict_accuracy"),
            }
        )
    trl = None
    if args.trl_json:
        trl = json.loads(args.trl_json.read_text())
    elif args.trl_minutes:
        script = Path(__file__).with_name("trl_grpo.py")
        command = [sys.executable, str(script), "--steps", "100000", "--minutes",
                   str(args.trl_minutes), "--val-every", str(args.trl_val_every)]  # fmt: skip
        proc = subprocess.run(command, capture_output=True, text=True, check=True)
        trl = json.loads(proc.stdout.strip().splitlines()[-1])
        (run_dir / "trl_grpo.json").write_text(json.dumps(trl))
    write_csv(rows, trl, run_dir / "learning_curve.csv")
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
    if trl and trl.get("validations"):
        print("validation score at equal training time:")
        ours = [(r["elapsed_s"], r["val"]) for r in rows if r["val"] is not None]
        theirs = [(v["train_s"], v["score"]) for v in trl["validations"]]
        above = compare(ours, theirs)
        print(f"creditrl above TRL at every point: {above}")
    print(f"wrote {run_dir / 'learning_curve.csv'} and {run_dir / 'learning_curve.png'}")


if __name__ == "__main__":
    main()
