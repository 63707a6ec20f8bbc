"""verl's config key names and creditrl's key for the same knob (docs/naming.md, written by hand).

``creditrl_name`` answers an unknown key: an exact entry first, then a verl section prefix
(``actor_rollout_ref.actor.X`` -> ``actor.X``) when creditrl has that key.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["VERL_NAMES", "VERL_PREFIXES", "creditrl_name"]

VERL_NAMES: dict[str, str] = {
    # batch sizes and lengths
    "data.max_response_length": "rollout.max_response_length",
    "actor_rollout_ref.rollout.response_length": "rollout.max_response_length",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_length",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "actor.ppo_micro_batch_size",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": (
        "actor.log_prob_micro_batch_size"
    ),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "actor.log_prob_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "actor.log_prob_micro_batch_size",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "actor.log_prob_micro_batch_size",
    "critic.ppo_micro_batch_size_per_gpu": "critic.ppo_micro_batch_size",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "actor.max_token_len_per_device",
    "critic.ppo_max_token_len_per_gpu": "critic.max_token_len_per_device",
    "actor_rollout_ref.model.use_remove_padding": "actor.use_remove_padding",
    # losses and optimisers
    "actor_rollout_ref.actor.policy_loss.loss_mode": "actor.policy_loss",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "actor_rollout_ref.actor.optim.warmup_style": "actor.optim.lr_scheduler",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "actor.optim.lr_scheduler",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "critic.optim.warmup_style": "critic.optim.lr_scheduler",
    "critic.optim.lr_scheduler_type": "critic.optim.lr_scheduler",
    # model and rollout engine
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "critic.model.path": "model.critic_path",
    "actor_rollout_ref.rollout.name": "rollout.engine",
    "actor_rollout_ref.rollout.dtype": "rollout.vllm_dtype",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "rollout.tensor_parallel_size",
    "actor_rollout_ref.rollout.val_kwargs.temperature": "rollout.val_temperature",
    "actor_rollout_ref.rollout.val_kwargs.n": "rollout.val_n",
    "actor_rollout_ref.actor.strategy": "trainer.strategy",
    "actor_rollout_ref.actor.fsdp_config.param_offload": "trainer.fsdp_cpu_offload",
    # multi-turn
    "actor_rollout_ref.rollout.multi_turn.enable": "agent.enable",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "agent.max_turns",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "agent.tool_config",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": "agent.max_parallel_calls",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": "agent.tool_output_max_chars",
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": "agent.truncate_side",
    # rewards
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.model.path": "reward.reward_model.path",
    "reward_model.micro_batch_size_per_gpu": "reward.reward_model.micro_batch_size",
    "custom_reward_function.path": "reward.scorer",
    # rollout correction (earlier verl releases: flat algorithm.rollout_is_* keys)
    "algorithm.rollout_is_threshold": "algorithm.rollout_is.threshold",
    "algorithm.rollout_is_threshold_lower": "algorithm.rollout_is.threshold_lower",
    "algorithm.rollout_is_level": "algorithm.rollout_is.level",
    "algorithm.rollout_is_mode": "algorithm.rollout_is.mode",
    "algorithm.rollout_is_veto_threshold": "algorithm.rollout_is.veto_threshold",
    # trainer
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.resume_mode": "trainer.resume",
    "trainer.max_actor_ckpt_to_keep": "trainer.max_checkpoints",
    "trainer.n_gpus_per_node": "trainer.workers",
    "data.filter_overlong_prompts": "data.overlong_prompt",
}

VERL_PREFIXES: dict[str, str] = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.rollout.": "rollout.",
    "actor_rollout_ref.model.": "model.",
    "algorithm.rollout_correction.": "algorithm.rollout_is.",
    "reward_model.overlong_buffer.": "algorithm.overlong_buffer.",
}


def creditrl_name(key: str, known: Collection[str]) -> str | None:
    """creditrl's key for verl's ``key``, or None when ``key`` is not a verl name we map."""
    if key in VERL_NAMES:
        return VERL_NAMES[key]
    for verl_prefix, ours in VERL_PREFIXES.items():
        if key.startswith(verl_prefix) and ours + key[len(verl_prefix) :] in known:
            return ours + key[len(verl_prefix) :]
    return None
