"""TRL's config names (``GRPOConfig``, a few of ``PPOConfig`` and ``ModelConfig``) and creditrl's
key for the same knob.

``TRL_NAMES`` is the one source: the loader answers an unknown key that is a TRL name with
``trl_hint``, and the "TRL's names" section of docs/naming.md is ``trl_names_markdown()``
(tests/test_config_names.py checks both, and that the hand-written tables of that page agree).
Where creditrl has no exact equivalent the entry says so and what differs, rather than
pointing at a key that means something else.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TRL_NAMES", "TrlName", "trl_hint", "trl_names_markdown"]


@dataclass(frozen=True)
class TrlName:
    """creditrl's ``key`` for a TRL name (None: no such setting), whether it is the same knob
    (``exact``), and what differs (``note``: a unit, the values, a second key)."""

    key: str | None
    note: str = ""
    exact: bool = True


def _near(key: str | None, note: str) -> TrlName:
    return TrlName(key, note, exact=False)


TRL_NAMES: dict[str, TrlName] = {
    # sizes and lengths
    "num_generations": TrlName("rollout.n"),
    "max_completion_length": TrlName("rollout.max_response_length"),
    "max_prompt_length": TrlName("data.max_prompt_length"),
    "generation_batch_size": _near(
        "data.train_batch_size",
        "TRL counts completions, data.train_batch_size counts prompts (each gives rollout.n "
        "trajectories)",
    ),
    "per_device_train_batch_size": _near(
        "actor.ppo_micro_batch_size",
        "TRL counts completions per device; actor.ppo_micro_batch_size is the forward/backward "
        "chunk in trajectories per process, and actor.ppo_mini_batch_size (prompts) sets the "
        "data per optimizer step",
    ),
    "gradient_accumulation_steps": _near(
        "actor.ppo_mini_batch_size",
        "creditrl accumulates each optimizer step over actor.ppo_mini_batch_size prompts x "
        "rollout.n trajectories, in chunks of actor.ppo_micro_batch_size",
    ),
    "steps_per_generation": _near(
        "actor.ppo_mini_batch_size",
        "optimizer steps per generated batch are data.train_batch_size / actor.ppo_mini_batch_size",
    ),
    "num_iterations": TrlName("actor.ppo_epochs"),
    "num_train_epochs": _near(
        "trainer.total_steps", "creditrl counts training steps, not passes over the data"
    ),
    "max_steps": TrlName("trainer.total_steps"),
    # sampling
    "temperature": TrlName("rollout.temperature"),
    "top_p": TrlName("rollout.top_p"),
    "top_k": TrlName("rollout.top_k"),
    "min_p": TrlName("rollout.min_p"),
    "repetition_penalty": TrlName(None, "creditrl's samplers have no repetition penalty"),
    "use_vllm": TrlName("rollout.engine", "rollout.engine=vllm"),
    # loss
    "loss_type": _near(
        "actor.loss_agg_mode",
        "the values differ: dapo and bnpo are token-mean, grpo is seq-mean-token-mean, "
        "dr_grpo is seq-mean-token-sum-norm",
    ),
    "beta": TrlName(
        "actor.kl_loss_coef",
        "with actor.use_kl_loss=true; TRL adds the KL term whenever beta > 0",
    ),
    "epsilon": TrlName("actor.clip_ratio", "actor.clip_ratio_low when epsilon_high is set"),
    "epsilon_high": TrlName("actor.clip_ratio_high"),
    "delta": _near(
        "actor.clip_ratio_c",
        "TRL's delta is INTELLECT-2's two-sided clip; actor.clip_ratio_c is the dual clip of "
        "negative advantages (c > 1)",
    ),
    "importance_sampling_level": _near(
        "actor.policy_loss", 'TRL\'s "sequence" (GSPO) is actor.policy_loss=gspo'
    ),
    "scale_rewards": _near(
        "algorithm.norm_adv_by_std_in_grpo",
        '"group" is true, "none" is false; "batch" (the batch\'s std) has no equivalent',
    ),
    "mask_truncated_completions": TrlName(
        None, "creditrl penalises overlong completions instead (algorithm.overlong_buffer.*)"
    ),
    "vllm_importance_sampling_correction": TrlName("algorithm.rollout_is.enable"),
    "vllm_importance_sampling_cap": TrlName("algorithm.rollout_is.threshold"),
    "max_grad_norm": TrlName("actor.grad_clip"),
    # PPOConfig
    "kl_coef": TrlName("algorithm.kl_ctrl.kl_coef", "with algorithm.use_kl_in_reward=true"),
    "kl_estimator": TrlName("algorithm.kl_penalty"),
    "cliprange_value": TrlName("critic.cliprange_value"),
    "gamma": TrlName("algorithm.gamma"),
    "lam": TrlName("algorithm.lam"),
    # optimiser
    "learning_rate": TrlName("actor.optim.lr"),
    "weight_decay": TrlName("actor.optim.weight_decay"),
    "lr_scheduler_type": TrlName("actor.optim.lr_scheduler", "constant or cosine"),
    "warmup_steps": TrlName("actor.optim.warmup_steps"),
    "warmup_ratio": _near("actor.optim.warmup_steps", "creditrl counts warm-up in steps"),
    # model (ModelConfig)
    "model_name_or_path": TrlName("model.path"),
    "gradient_checkpointing": TrlName("model.gradient_checkpointing"),
    "lora_r": TrlName("model.lora_rank"),
    "lora_alpha": TrlName("model.lora_alpha"),
    "bf16": _near("actor.autocast", "actor.autocast=bf16 trains under bfloat16 autocast"),
    # the run
    "seed": TrlName("trainer.seed", "data.seed orders the prompts"),
    "output_dir": TrlName("trainer.output_dir"),
    "save_steps": TrlName("trainer.save_freq"),
    "save_total_limit": TrlName("trainer.max_checkpoints"),
    "eval_steps": TrlName("trainer.test_freq"),
    "logging_steps": TrlName(None, "creditrl logs every step's metrics to metrics.jsonl"),
    "report_to": TrlName("trainer.logger", "jsonl, tensorboard, wandb, mlflow"),
    "log_completions": _near(
        "trainer.rollout_dump_rows", "the rows of each step written to rollouts/"
    ),
}


def trl_hint(name: str) -> str | None:
    """What creditrl calls TRL's ``name`` ("creditrl calls it 'rollout.n'", "creditrl's
    nearest is '...', not the same knob: ...", "creditrl has no such setting: ..."), or None
    when ``name`` is not a TRL name listed here."""
    entry = TRL_NAMES.get(name)
    if entry is None:
        return None
    if entry.key is None:
        return f"creditrl has no such setting: {entry.note}"
    if not entry.exact:
        return f"creditrl's nearest is '{entry.key}', not the same knob: {entry.note}"
    return f"creditrl calls it '{entry.key}'" + (f" ({entry.note})" if entry.note else "")


def trl_names_markdown() -> str:
    """The "TRL's names" table of docs/naming.md: every entry of ``TRL_NAMES``."""
    lines = [
        "| TRL | creditrl | same knob? |",
        "|---|---|---|",
    ]
    for name, entry in sorted(TRL_NAMES.items()):
        key = f"`{entry.key}`" if entry.key else "—"
        same = "yes" if entry.exact and entry.key else "no"
        note = f"{same}: {entry.note}" if entry.note else same
        lines.append(f"| `{name}` | {key} | {note} |")
    return "\n".join(lines) + "\n"
