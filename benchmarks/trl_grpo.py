"""TRL's GRPOTrainer on the main job's task and shape (needs the `bench` extra: trl).

Used by step_time.py and learning_curve.py: 4 prompts x 4 samples per step, 96 new tokens,
SmolLM2-135M-Instruct (the embedded model), the same chain_sum prompts and the same reward
function as creditrl's default; TRL's defaults otherwise (no reference model, one iteration
per batch), gradient checkpointing off. Prints one JSON line: per-step seconds, rewards and
timestamps, and peak memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time

from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from creditrl.config import Config
from creditrl.data.tasks import build_task_rows
from creditrl.models import embedded_model_dir, load_tokenizer
from creditrl.rewards.scorers import reasoning_gym_score


def chain_sum_reward(completions, ground_truth, rg_entry, **_):
    """creditrl's default reward for the task, on TRL's conversational completions."""
    return [
        reasoning_gym_score(
            "reasoning_gym/chain_sum", c[0]["content"], gt, {"rg_entry": json.loads(entry)}
        )["score"]
        for c, gt, entry in zip(completions, ground_truth, rg_entry, strict=True)
    ]


class StepClock(TrainerCallback):
    """Wall-clock seconds of each optimizer step, and when it ended."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.seconds: list[float] = []
        self.ended: list[float] = []
        self._t = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.seconds.append(now - self._t)
        self.ended.append(now - self.began)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=Config().actor.optim.lr)
    parser.add_argument("--temperature", type=float, default=Config().rollout.temperature)
    args = parser.parse_args()
    data = Config().data
    rows = build_task_rows(data.task, data.task_kwargs, data.train_size, data.val_size, data.seed)
    dataset = Dataset.from_list(
        [
            {
                "prompt": r.messages,
                "ground_truth": str(r.ground_truth),
                "rg_entry": json.dumps(r.extra["rg_entry"]),
            }
            for r in rows.train
        ]
    )
    model_dir = embedded_model_dir()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=96,
        learning_rate=args.lr,
        temperature=args.temperature,
        max_steps=args.steps,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=data.seed,
    )
    clock = StepClock()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=chain_sum_reward,
        args=config,
        train_dataset=dataset,
        processing_class=load_tokenizer(model_dir),
        callbacks=[clock],
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    timed = clock.seconds[1:] or clock.seconds
    report = {
        "steps": len(timed),
        "step_s": statistics.median(timed),
        "step_seconds": clock.seconds,
        "ended_s": clock.ended,
        "rewards": rewards,
        "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
