"""Steps per second of the main job's shape with 1 worker in process vs N Ray workers.

Run: .venv/bin/python benchmarks/scaling.py [--steps 4] [--workers 2] [key=value ...]

Each configuration runs in its own subprocess (so Ray and thread settings do not leak): the
default GRPO config (4 prompts x 4 samples, 96 new tokens, SmolLM2-135M-Instruct), validation
and checkpoints off, the first step a warm-up that is not counted. The in-process run uses all
cores in one process; the Ray run gives each worker ``cores / workers`` threads
(``trainer.ray.cpus_per_worker``). Prints and writes ``benchmarks/results/scaling.json``:
median seconds per step, steps/s, generated tokens/s and the per-stage medians of each.

On a machine with CUDA, also runs ``benchmarks/vllm_rollout.py`` (vLLM vs HF rollout tokens/s
and the vLLM/trainer log-prob mismatch) and folds its figures in.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHAPE = ["data.train_batch_size=4", "rollout.n=4", "rollout.max_response_length=96"]
RESULTS = Path(__file__).parent / "results" / "scaling.json"


def measure(steps: int, overrides: list[str]) -> dict:
    """Run the trainer here for ``steps`` + 1 steps; per-step medians of the counted steps."""
    from creditrl.config.loader import load_config
    from creditrl.trainers.rl_trainer import RLTrainer

    out = tempfile.mkdtemp(prefix="creditrl-scaling-")
    cfg = load_config(
        overrides=[
            *SHAPE,
            f"trainer.total_steps={steps + 1}",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.save_freq=0",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={out}",
            *overrides,
        ]
    )
    began = time.perf_counter()
    trainer = RLTrainer(cfg)
    setup_s = time.perf_counter() - began
    per_step, stages, tokens = [], {}, []
    try:
        for step in range(steps + 1):
            trainer.step = step + 1
            start = time.perf_counter()
            metrics = trainer.train_step()
            elapsed = time.perf_counter() - start
            if step == 0:
                continue
            per_step.append(elapsed)
            tokens.append(
                float(trainer.last_batch["response_mask"].sum()) / metrics["timing_s/gen"]
            )
            for key, value in metrics.items():
                if key.startswith("timing_s/") and key != "timing_s/step":
                    stages.setdefault(key.removeprefix("timing_s/"), []).append(value)
    finally:
        trainer.close()
    median = statistics.median(per_step)
    return {
        "setup_s": round(setup_s, 1),
        "s_per_step": round(median, 3),
        "steps_per_s": round(1 / median, 4),
        "gen_tokens_per_s": round(statistics.median(tokens), 1),
        "stages_s": {k: round(statistics.median(v), 3) for k, v in sorted(stages.items())},
        "steps_counted": steps,
    }


def in_subprocess(steps: int, overrides: list[str]) -> dict:
    """``measure`` in a fresh interpreter; its JSON answer."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); from scaling import measure; "
        f"print('RESULT' + json.dumps(measure({steps}, {overrides!r})))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark run failed ({overrides}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    per_worker = max(cores // args.workers, 1)
    runs = {
        "local_1_worker": in_subprocess(args.steps, args.overrides),
        f"ray_{args.workers}_workers": in_subprocess(
            args.steps,
            [
                "trainer.backend=ray",
                f"trainer.workers={args.workers}",
                f"trainer.ray.cpus_per_worker={per_worker}",
                *args.overrides,
            ],
        ),
    }
    result = {"cores": cores, "shape": SHAPE, "overrides": args.overrides, "runs": runs}
    base = runs["local_1_worker"]["steps_per_s"]
    result["speedup"] = {k: round(v["steps_per_s"] / base, 3) for k, v in runs.items()}
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda and Path("benchmarks/vllm_rollout.py").is_file():
        done = subprocess.run(
            [sys.executable, "benchmarks/vllm_rollout.py"], capture_output=True, text=True
        )
        result["vllm_rollout"] = (
            done.stdout[-4000:] if done.returncode == 0 else done.stderr[-2000:]
        )
    else:
        result["vllm_rollout"] = "skipped: no CUDA device on this machine"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
