"""Rollout engines behind one interface (``RolloutEngine``) and a registry (``rollout.engine``):
sample responses (token ids, masks, log-probs) for a prompt Batch. The built-in engines, ``hf``
and ``vllm``, are declared in ``creditrl.rollout.registries`` and imported when built; names
here are imported on first use, so the registries are read without importing torch."""

from __future__ import annotations

from creditrl.lazy import names_on_first_use

_HOMES = {
    "ROLLOUT_ENGINES": "creditrl.rollout.registries",
    "EngineArgs": "creditrl.rollout.engine",
    "EngineTraits": "creditrl.rollout.registries",
    "HFRolloutEngine": "creditrl.rollout.hf_engine",
    "RolloutEngine": "creditrl.rollout.engine",
    "SamplingParams": "creditrl.rollout.sampling",
    "StrategyTraits": "creditrl.rollout.strategies",
    "VLLMRolloutEngine": "creditrl.rollout.vllm_engine",
    "build_rollout_engine": "creditrl.rollout.engine",
    "check_rollout_engine": "creditrl.rollout.registries",
    "check_sampling_replay": "creditrl.rollout.registries",
    "engine_traits": "creditrl.rollout.registries",
    "eos_token_ids_of": "creditrl.rollout.sampling",
    "filter_logits": "creditrl.rollout.sampling",
    "kept_sets_recorded": "creditrl.rollout.registries",
    "register_rollout_engine": "creditrl.rollout.registries",
    "register_rollout_strategy": "creditrl.rollout.strategies",
    "rollout_log_probs_are_actors": "creditrl.rollout.registries",
    "sample_next_tokens": "creditrl.rollout.sampling",
}

__all__ = sorted(_HOMES)


__getattr__ = names_on_first_use(__name__, _HOMES)
