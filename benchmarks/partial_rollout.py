"""Asynchronous training with partial rollout against without it, at equal wall time.

Run: .venv/bin/python benchmarks/partial_rollout.py [--seconds 300] [--out DIR]
     [--arms drop,partial] [key=value ...]

Each arm is ``creditrl async`` (learner and ``asynchronous.num_samplers=2`` samplers, one
torch thread each; GRPO, SmolLM2-135M-Instruct, reasoning-gym's ``basic_arithmetic`` with its
own defaults, whose answers run from 10 to 200+ tokens (chain_sum's are all about 15), 4
prompts x 4 answers of up to 256 new tokens; ``max_staleness=1``; validation on 16 held-out
prompts every 4 steps) plus the overrides, stopped ``--seconds`` after its first step began:

- ``drop``: today's default: a sampler takes new weights between batches only, and a group
  staler than ``max_staleness`` is dropped;
- ``partial``: ``asynchronous.partial_rollout=true`` (new weights between decode chunks of
  32 tokens, unfinished rows continued on them) and ``staleness_policy=keep`` (late groups
  are trained, each token's importance weight bounded by ``algorithm.rollout_is``);
- ``partial_drop``: partial rollout with the ``drop`` policy.

Per arm, over the steps that ended within the window: learner steps, trained tokens per
minute (``perf/total_num_tokens``: prompt + response), groups dropped, the samplers' idle
seconds (waiting for acknowledgements or fresher weights: ``sampler/idle_s``), weight switches
inside batches, mean per-token staleness, the length and score of dropped / late groups
against trained ones (``async/{dropped,late,trained}/*``), and the validation score by wall
time (its gain per minute from the first validation to the last). Arms run one after the
other; the machine's mean load and other busy processes are recorded with each.

Writes ``benchmarks/results/partial_rollout.{json,md}``; run folders go under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from async_vs_sync import async_start, read_jsonl, run_for
from machine import cpu_flags

RESULTS = Path(__file__).parent / "results"
COMMON = [
    "trainer.total_steps=100000",
    "trainer.val_before_train=true",
    "trainer.test_freq=4",
    "data.val_size=16",
    "trainer.save_freq=0",
    "trainer.logger=[jsonl]",
    "data.task=basic_arithmetic",
    "data.task_kwargs={}",
    "rollout.max_response_length=256",
    "asynchronous.num_samplers=2",
    "asynchronous.max_staleness=1",
    "asynchronous.learner_threads=1",
    "asynchronous.sampler_threads=1",
    "asynchronous.port=0",
]
ARMS = {
    "drop": [],
    "partial": ["asynchronous.partial_rollout=true", "asynchronous.staleness_policy=keep"],
    "partial_drop": ["asynchronous.partial_rollout=true"],
}
BIAS = [
    f"async/{kind}/{name}"
    for kind in ("trained", "late", "dropped")
    for name in ("episodes", "response_length", "score")
]


def sampler_rows(out: Path) -> list[list[dict]]:
    """Each sampler's metrics rows (one per batch)."""
    folders = sorted((out / "samplers").glob("s*"))
    return [read_jsonl(folder / "metrics.jsonl") for folder in folders]


def summarise(out: Path, start: float, rows: list[dict], seconds: float) -> dict:
    """The arm's figures over the ``rows`` (learner steps) that ended within the window."""
    if not rows:
        raise SystemExit("no step ended within --seconds; give the runs more time")
    minutes = seconds / 60
    last = rows[-1]
    end = start + seconds
    samplers = [[b for b in batches if b["time"] <= end] for batches in sampler_rows(out)]
    validations = [
        (r["time"] - start, r["val/score"])
        for r in read_jsonl(out / "metrics.jsonl")
        if "val/score" in r and r["time"] <= start + seconds
    ]
    gain = None
    if len(validations) >= 2:
        (t0, v0), (t1, v1) = validations[0], validations[-1]
        gain = (v1 - v0) / max((t1 - t0) / 60, 1e-9)
    return {
        "steps": len(rows),
        "trained_tokens_per_min": sum(r["perf/total_num_tokens"] for r in rows) / minutes,
        "dropped_groups": last.get("async/dropped_stale_groups", 0.0),
        "sampler_idle_s": sum(b[-1].get("sampler/idle_s", 0.0) for b in samplers if b),
        "sampler_batches": sum(len(b) for b in samplers),
        "weight_switches": sum(x.get("sampler/weight_switches", 0.0) for b in samplers for x in b),
        "mean_staleness": sum(r["async/staleness/mean"] for r in rows) / len(rows),
        "mean_token_staleness": (
            sum(r.get("async/token_staleness/mean", r["async/staleness/mean"]) for r in rows)
            / len(rows)
        ),
        "bias": {k: last[k] for k in BIAS if k in last},
        "validation": [{"elapsed_s": t, "score": v} for t, v in validations],
        "val_score_gain_per_min": gain,
        "score_last_5": sum(r["critic/score/mean"] for r in rows[-5:]) / min(5, len(rows)),
    }


def markdown(result: dict) -> str:
    """The results table."""
    lines = [
        f"# Partial rollout, {result['seconds_each']:.0f} s per arm",
        "",
        f"Command: `{result['command']}`  ",
        f"CPU: {result['cpu']}",
        "",
        "| arm | steps | trained tok/min | dropped groups | sampler idle s | switches | "
        "token staleness | val gain/min | late len / score | trained len / score | "
        "dropped len / score | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in result["arms"].items():
        b = r["bias"]

        def pair(kind: str, b: dict = b) -> str:
            if not b.get(f"async/{kind}/episodes"):
                return "-"
            return f"{b[f'async/{kind}/response_length']:.0f} / {b[f'async/{kind}/score']:.2f}"

        gain = r["val_score_gain_per_min"]
        lines.append(
            f"| {name} | {r['steps']} | {r['trained_tokens_per_min']:.0f} | "
            f"{r['dropped_groups']:.0f} | {r['sampler_idle_s']:.0f} | {r['weight_switches']:.0f} "
            f"| {r['mean_token_staleness']:.2f} | "
            f"{'-' if gain is None else f'{gain:+.3f}'} | {pair('late')} | {pair('trained')} | "
            f"{pair('dropped')} | {r['machine']['mean_load_1min']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=300.0, help="wall time of each arm")
    parser.add_argument("--out", type=Path, default=Path("/tmp/creditrl_partial_rollout"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--arms", default="drop,partial")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from creditrl.asynchronous.launcher import child_commands, load_from_args

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    command = " ".join(["benchmarks/partial_rollout.py", *sys.argv[1:]])
    result = {"seconds_each": args.seconds, "arms": {}, "overrides": args.overrides,
              "cpu": cpu_flags(), "command": command}  # fmt: skip
    for name in args.arms.split(","):
        out = args.out / name
        overrides = [*COMMON, *ARMS[name], *args.overrides, f"trainer.output_dir={out}"]
        cfg, config_file, overrides = load_from_args(overrides)
        learners, samplers = child_commands(cfg, config_file, overrides)
        print(f"{name}: {args.seconds:.0f}s ...", flush=True)
        start, rows, machine = run_for(
            learners + samplers, out, args.seconds, async_start, args.out / f"{name}.log"
        )
        result["arms"][name] = {**summarise(out, start, rows, args.seconds), "machine": machine}
        print(json.dumps({k: v for k, v in result["arms"][name].items() if k != "validation"}))
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "partial_rollout.json").write_text(json.dumps(result, indent=1))
    (args.results / "partial_rollout.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
