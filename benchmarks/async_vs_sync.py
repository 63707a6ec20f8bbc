"""Asynchronous (1 sampler + 1 learner) vs synchronous training at the same batch shape and
equal wall time: trained tokens/s, mean staleness, and both learning curves.

Run: .venv/bin/python benchmarks/async_vs_sync.py [--seconds 300] [--out DIR] [key=value ...]

Both runs use the default config (GRPO, SmolLM2-135M-Instruct, chain_sum, 4 prompts x 4
answers, up to 96 new tokens) plus the overrides, without validation or checkpoints, and the
same CPU threads in total: the synchronous trainer ``trainer.num_threads=2``; the sampler and
the learner one each. Each run is a subprocess, stopped ``--seconds`` after its first step
began (model loading is not counted); only steps that ended within that window count.

- trained tokens/s = sum over counted steps of ``perf/total_num_tokens`` (prompt + response
  tokens of the trained batch) / (end of the last counted step - start of the first);
- async start = the earlier of the sampler's first batch start and the learner's first step
  start; mean staleness = mean over steps of ``async/staleness/mean``;
- learning curve = ``critic/score/mean`` (training reward) by wall time since start;
- the machine: the mean 1-minute load average during each run and the other processes that
  were busy (other users share the cores).

Writes ``benchmarks/results/async_vs_sync.json`` and ``.png``; run directories (with their
metrics.jsonl) go under ``--out`` (default /tmp/creditrl_async_vs_sync).
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

RESULTS = Path(__file__).parent / "results"
COMMON = [
    "trainer.total_steps=100000",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.save_freq=0",
    "trainer.logger=[jsonl]",
]


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    return rows


def step_rows(out: Path) -> list[dict]:
    return [r for r in read_jsonl(out / "metrics.jsonl") if r.get("step", 0) >= 1]


def sync_start(out: Path) -> float | None:
    rows = step_rows(out)
    return rows[0]["time"] - rows[0]["timing_s/step"] if rows else None


def async_start(out: Path) -> float | None:
    starts = [r["time"] - r["perf/time_per_step"] for r in step_rows(out)[:1]]
    batches = read_jsonl(out / "samplers" / "s0" / "metrics.jsonl")
    starts += [b["time"] - b["timing_s/batch"] for b in batches[:1]]
    return min(starts) if len(starts) == 2 else None


def other_processes(mine: set[int]) -> list[str]:
    """Commands of the other processes using >= 20% of a core right now (the machine is
    shared), from ``ps``."""
    lines = subprocess.run(
        ["ps", "-eo", "pid,ppid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True
    ).stdout.splitlines()[1:]
    busy = []
    for line in lines:
        pid, ppid, cpu, args = line.split(None, 3)
        if float(cpu) >= 20 and int(pid) not in mine and int(ppid) not in mine:
            busy.append(f"{float(cpu):.0f}% {args[:100]}")
    return busy


def run_for(
    cmds: list[list[str]], out: Path, seconds: float, start_of, log: Path
) -> tuple[float, list[dict], dict]:
    """Run ``cmds`` until ``seconds`` after the run's start; return (start, counted steps,
    what else the machine was doing: mean 1-min load average, busy foreign processes)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("w") as f:
        procs = [subprocess.Popen(c, stdout=f, stderr=subprocess.STDOUT, env=env) for c in cmds]
    start = None
    loads, seen = [], {}
    mine = {os.getpid(), *(p.pid for p in procs)}
    try:
        while True:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[3]} exited with {p.returncode}; see {log}")
            start = start or start_of(out)
            if start is not None and time.time() > start + seconds:
                break
            if start is not None:
                loads.append(os.getloadavg()[0])
                if len(loads) % 30 == 1:
                    for entry in other_processes(mine):
                        seen[entry.split(" ", 1)[1]] = entry
            time.sleep(1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    machine = {"mean_load_1min": sum(loads) / max(len(loads), 1), "others": list(seen.values())}
    return start, [r for r in step_rows(out) if r["time"] <= start + seconds], machine


def summarise(start: float, rows: list[dict]) -> dict:
    if not rows:
        raise SystemExit("no step ended within --seconds; give the runs more time")
    tokens = sum(r["perf/total_num_tokens"] for r in rows)
    elapsed = rows[-1]["time"] - start
    summary = {
        "steps": len(rows),
        "trained_tokens": tokens,
        "seconds": elapsed,
        "trained_tokens_per_s": tokens / elapsed,
        "seconds_per_step": elapsed / len(rows),
        "curve": [
            {"elapsed_s": r["time"] - start, "score": r["critic/score/mean"], "step": r["step"]}
            for r in rows
        ],
    }
    k = min(5, len(rows))
    summary["score_first_5"] = sum(r["critic/score/mean"] for r in rows[:k]) / k
    summary["score_last_5"] = sum(r["critic/score/mean"] for r in rows[-k:]) / k
    return summary


def rolling(values: list[float], k: int = 5) -> list[float]:
    return [sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1])
            for i in range(len(values))]  # fmt: skip


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, bars) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=[2, 1])
    for name, color in (("sync", "tab:blue"), ("async", "tab:orange")):
        points = result[name]["curve"]
        minutes = [p["elapsed_s"] / 60 for p in points]
        scores = [p["score"] for p in points]
        curve.plot(minutes, scores, ".", color=color, alpha=0.35)
        label = f"{name} ({result[name]['steps']} steps)"
        curve.plot(minutes, rolling(scores), "-", color=color, label=label)
    curve.set_xlabel("wall time since the first step began (min)")
    curve.set_ylabel("training reward (mean; line: rolling 5)")
    curve.set_title("chain_sum, SmolLM2-135M, 4 prompts x 4 answers")
    curve.legend()
    names = ["sync", "async"]
    values = [result[n]["trained_tokens_per_s"] for n in names]
    bars.bar(names, values, color=["tab:blue", "tab:orange"])
    bars.set_ylabel("trained tokens / s")
    staleness = result["async"]["mean_staleness"]
    bars.set_title(f"throughput (async mean staleness {staleness:.2f})")
    for i, v in enumerate(values):
        bars.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=300.0, help="wall time of each run")
    parser.add_argument("--out", type=Path, default=Path("/tmp/creditrl_async_vs_sync"))
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    from creditrl.asynchronous.launcher import child_commands, load_from_args

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    base = [sys.executable, "-m", "creditrl.cli"]
    sync_out = args.out / "sync"
    sync_cmd = [*base, "train", *COMMON, "trainer.num_threads=2", *args.overrides]
    sync_cmd.append(f"trainer.output_dir={sync_out}")
    print(f"sync: {args.seconds:.0f}s ...", flush=True)
    start, rows, machine = run_for(
        [sync_cmd], sync_out, args.seconds, sync_start, args.out / "sync.log"
    )
    result = {"sync": {**summarise(start, rows), "machine": machine}}

    async_out = args.out / "async"
    overrides = [*COMMON, *args.overrides, f"trainer.output_dir={async_out}"]
    overrides += ["asynchronous.port=0", "asynchronous.learner_threads=1"]
    overrides += ["asynchronous.sampler_threads=1", "asynchronous.num_samplers=1"]
    cfg, config_file, overrides = load_from_args(overrides)
    learners, samplers = child_commands(cfg, config_file, overrides)
    print(f"async: {args.seconds:.0f}s ...", flush=True)
    start, rows, machine = run_for(
        learners + samplers, async_out, args.seconds, async_start, args.out / "async.log"
    )
    result["async"] = {**summarise(start, rows), "machine": machine}
    result["async"]["mean_staleness"] = sum(r["async/staleness/mean"] for r in rows) / len(rows)
    result["async"]["max_staleness"] = max(r["async/staleness/max"] for r in rows)
    result["async"]["dropped_stale_groups"] = rows[-1].get("async/dropped_stale_groups", 0)
    for key in ("wait", "old_log_prob", "update_actor", "publish"):
        values = [r.get(f"timing_s/{key}", 0.0) for r in rows]
        result["async"][f"learner_{key}_s_mean"] = sum(values) / len(values)
    batches = read_jsonl(async_out / "samplers" / "s0" / "metrics.jsonl")
    result["async"]["sampler_batch_s_mean"] = sum(b["timing_s/batch"] for b in batches) / len(
        batches
    )
    result["speedup_tokens_per_s"] = (
        result["async"]["trained_tokens_per_s"] / result["sync"]["trained_tokens_per_s"]
    )
    result["seconds_each"] = args.seconds
    result["overrides"] = args.overrides
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "async_vs_sync.json").write_text(json.dumps(result, indent=1))
    plot(result, args.results / "async_vs_sync.png")
    for name in ("sync", "async"):
        r = result[name]
        print(
            f"{name}: {r['steps']} steps in {r['seconds']:.0f}s, "
            f"{r['trained_tokens_per_s']:.1f} trained tokens/s, "
            f"{r['seconds_per_step']:.1f} s/step, "
            f"reward first 5 {r['score_first_5']:.3f} -> last 5 {r['score_last_5']:.3f}"
        )
    for name in ("sync", "async"):
        machine = result[name]["machine"]
        print(f"{name}: mean load {machine['mean_load_1min']:.1f}; also busy: {machine['others']}")
    print(
        f"speedup {result['speedup_tokens_per_s']:.2f}x; async mean staleness "
        f"{result['async']['mean_staleness']:.2f} (max {result['async']['max_staleness']:.0f})"
    )
    print(f"wrote {args.results / 'async_vs_sync.json'} and .png")


if __name__ == "__main__":
    main()
