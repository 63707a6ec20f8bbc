"""Seconds per training step, by stage, for the main job's shape; optionally TRL beside it.

Run: .venv/bin/python benchmarks/step_time.py [--steps 4] [--trl] [key=value ...]

Ours: the default GRPO config (4 prompts x 4 samples, 96 new tokens, SmolLM2-135M-Instruct,
chain_sum), validation and checkpoints off; the first step is a warm-up and is not counted.
Prints the median seconds per step, each stage's median, generated tokens/s and peak memory
(max RSS). With --trl (needs the `bench` extra), runs TRL's GRPOTrainer in a subprocess on the
same model, prompts, group size and max new tokens, and prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = ["data.train_batch_size=4", "rollout.n=4", "rollout.max_response_length=96"]


def peak_rss_gb() -> float:
    """Peak resident memory of this process, GB (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run_ours(steps: int, overrides: list[str]) -> dict:
    from creditrl.config.loader import load_config
    from creditrl.trainers.rl_trainer import RLTrainer

    out = tempfile.mkdtemp(prefix="creditrl-steptime-")
    cfg = load_config(
        overrides=[
            *SHAPE,
            f"trainer.total_steps={steps + 1}",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={out}",
            *overrides,
        ]
    )
    trainer = RLTrainer(cfg)
    stages: dict[str, list[float]] = {}
    tokens_per_s = []
    for step in range(steps + 1):
        trainer.step = step + 1
        metrics = trainer.train_step()
        if step == 0:
            continue
        for key, value in metrics.items():
            if key.startswith("timing_s/"):
                stages.setdefault(key.removeprefix("timing_s/"), []).append(value)
        generated = float(trainer.last_batch["response_mask"].sum())
        tokens_per_s.append(generated / metrics["timing_s/gen"])
        print(f"  step {step}: {metrics['timing_s/step']:.2f} s", flush=True)
    trainer.reward.close()
    return {
        "step_s": statistics.median(stages["step"]),
        "stages": {k: statistics.median(v) for k, v in stages.items()},
        "gen_tokens_per_s": statistics.median(tokens_per_s),
        "peak_gb": peak_rss_gb(),
    }


def run_trl(steps: int) -> dict:
    """TRL's GRPOTrainer in a subprocess (benchmarks/trl_grpo.py); its JSON report."""
    script = Path(__file__).with_name("trl_grpo.py")
    proc = subprocess.run(
        [sys.executable, str(script), "--steps", str(steps + 1)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"TRL run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--trl", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    began = time.perf_counter()
    ours = run_ours(args.steps, args.overrides)
    print(
        f"creditrl: {ours['step_s']:.2f} s/step (median of {args.steps}), "
        f"generation {ours['gen_tokens_per_s']:.0f} tokens/s, peak RSS {ours['peak_gb']:.2f} GB"
    )
    for stage, seconds in sorted(ours["stages"].items(), key=lambda kv: -kv[1]):
        print(f"    {stage:<16} {seconds:7.2f} s")
    if args.trl:
        trl = run_trl(args.steps)
        print(
            f"TRL GRPOTrainer: {trl['step_s']:.2f} s/step (median of {trl['steps']}), "
            f"generation {trl.get('gen_s', float('nan')):.2f} s/step, "
            f"peak RSS {trl['peak_gb']:.2f} GB"
        )
        print(f"speed-up: {trl['step_s'] / ours['step_s']:.2f}x per step")
    print(f"(benchmark wall time {time.perf_counter() - began:.0f} s)")


if __name__ == "__main__":
    main()
