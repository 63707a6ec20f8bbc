"""TRL's GRPOTrainer on a creditrl config's task and shape (needs the `bench` extra: trl).

Used by step_time.py, learning_curve.py and learning_suite.py. The config (``--preset`` and
``key=value`` overrides, resolved by creditrl) gives both sides the same prompts (task,
difficulty, worked examples, seed), group size (``rollout.n`` = ``num_generations``), prompts
per optimizer step (``data.train_batch_size`` x ``rollout.n`` completions per step),
``max_response_length`` (``max_completion_length``), learning rate, temperature and reward (the
run's reasoning-gym scorer); TRL's defaults otherwise (no reference model, one iteration per
batch), gradient checkpointing off. Without a preset: the default run (chain_sum).

With ``--val-every N`` it validates before step 1 and every N steps exactly as creditrl does:
greedy answers (creditrl's HF engine on TRL's model) to the same held-out prompts, scored by
the same function; the validation time is kept out of ``train_s``. ``--minutes M`` stops
after M minutes of training time. Prints one JSON line: per-step seconds, rewards, training
time at each step's end, the validations, and peak memory.
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

from creditrl.config.loader import load_config
from creditrl.config.schema import RolloutConfig
from creditrl.data import build_datasets, build_task_rows
from creditrl.models import embedded_model_dir, load_tokenizer
from creditrl.rewards.scorers import reasoning_gym_score
from creditrl.rollout import HFRolloutEngine


def task_reward(completions, ground_truth, rg_entry, data_source, **_):
    """creditrl's reward for the task (its reasoning-gym scorer), on TRL's conversational
    completions."""
    return [
        reasoning_gym_score(source, c[0]["content"], gt, {"rg_entry": json.loads(entry)})["score"]
        for c, gt, entry, source in zip(
            completions, ground_truth, rg_entry, data_source, strict=True
        )
    ]


def greedy_validation(model, tokenizer, val, max_length: int = 96) -> dict[str, float]:
    """creditrl's validation on ``model``: greedy answers to every row of the PromptDataset
    ``val``, mean score and strict accuracy (tagged and correct)."""
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(max_response_length=max_length))
    out = engine.generate(val.batch(list(range(len(val)))), greedy=True)
    scores, strict = [], []
    for i in range(len(out)):
        length = int(out["response_mask"][i].sum())
        text = tokenizer.decode(out["responses"][i, :length], skip_special_tokens=True)
        extra = out["extra_info"][i]
        result = reasoning_gym_score(out["data_source"][i], text, out["ground_truth"][i], extra)
        scores.append(result["score"])
        strict.append(float(result["answer_score"] >= 1 and result["format_score"] >= 1))
    return {"score": statistics.mean(scores), "strict_accuracy": statistics.mean(strict)}


class StepClock(TrainerCallback):
    """Seconds of each optimizer step and training time at its end; validation every
    ``val_every`` steps (and before the first) with the clock stopped."""

    def __init__(self, tokenizer, val, val_every: int, minutes: float, max_length: int) -> None:
        self.tokenizer, self.val, self.val_every = tokenizer, val, val_every
        self.limit_s, self.max_length = minutes * 60, max_length
        self.seconds: list[float] = []
        self.ended: list[float] = []
        self.validations: list[dict[str, float]] = []
        self._t = 0.0

    def validate(self, model, step: int) -> None:
        if self.val_every > 0:
            train_s = self.ended[-1] if self.ended else 0.0
            result = greedy_validation(model, self.tokenizer, self.val, self.max_length)
            self.validations.append({"step": step, "train_s": train_s, **result})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.validate(model, 0)

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.seconds.append(time.perf_counter() - self._t)
        self.ended.append(sum(self.seconds))
        out_of_time = self.limit_s > 0 and self.ended[-1] >= self.limit_s
        if out_of_time or state.global_step >= state.max_steps:
            control.should_training_stop = True
        if self.val_every > 0 and (
            state.global_step % self.val_every == 0 or control.should_training_stop
        ):
            self.validate(model, state.global_step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--preset", help="a creditrl preset (default: the default run)")
    parser.add_argument("--lr", type=float, help="default: the config's actor.optim.lr")
    parser.add_argument("--temperature", type=float, help="default: rollout.temperature")
    parser.add_argument("--val-every", type=int, default=0)
    parser.add_argument("--minutes", type=float, default=0.0)
    parser.add_argument("overrides", nargs="*", help="creditrl key=value overrides")
    args = parser.parse_args()
    preset = [f"preset={args.preset}"] if args.preset else []
    cfg = load_config(overrides=[*preset, *args.overrides])
    data, rollout = cfg.data, cfg.rollout
    rows = build_task_rows(
        data.task,
        data.task_kwargs,
        data.train_size,
        data.val_size,
        data.seed,
        data.system_prompt,
        data.few_shot,
    )
    dataset = Dataset.from_list(
        [
            {
                "prompt": r.messages,
                "ground_truth": str(r.ground_truth),
                "rg_entry": json.dumps(r.extra["rg_entry"]),
                "data_source": r.data_source,
            }
            for r in rows.train
        ]
    )
    model_dir = embedded_model_dir()
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-grpo-"),
        per_device_train_batch_size=data.train_batch_size * rollout.n,
        num_generations=rollout.n,
        max_completion_length=rollout.max_response_length,
        learning_rate=args.lr if args.lr is not None else cfg.actor.optim.lr,
        temperature=args.temperature if args.temperature is not None else rollout.temperature,
        max_steps=args.steps,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=data.seed,
    )
    tokenizer = load_tokenizer(model_dir)
    val = build_datasets(data, tokenizer)[1]
    clock = StepClock(tokenizer, val, args.val_every, args.minutes, rollout.max_response_length)
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=task_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
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
        "train_s": clock.ended,
        "validations": clock.validations,
        "rewards": rewards,
        "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
