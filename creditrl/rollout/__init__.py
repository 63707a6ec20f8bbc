"""Rollout engines behind one interface (``RolloutEngine``) and a registry (``rollout.engine``):
sample responses (token ids, masks, log-probs) for a prompt Batch. Importing this package
registers the built-in engines, ``hf`` and ``vllm``."""

from creditrl.rollout.engine import (
    ROLLOUT_ENGINES,
    EngineArgs,
    EngineTraits,
    RolloutEngine,
    build_rollout_engine,
    check_rollout_engine,
    check_sampling_replay,
    engine_traits,
    kept_sets_recorded,
    register_rollout_engine,
    rollout_log_probs_are_actors,
)
from creditrl.rollout.hf_engine import HFRolloutEngine
from creditrl.rollout.sampling import (
    SamplingParams,
    eos_token_ids_of,
    filter_logits,
    sample_next_tokens,
)
from creditrl.rollout.strategies import StrategyTraits, register_rollout_strategy
from creditrl.rollout.vllm_engine import VLLMRolloutEngine

__all__ = [
    "ROLLOUT_ENGINES",
    "EngineArgs",
    "EngineTraits",
    "HFRolloutEngine",
    "RolloutEngine",
    "SamplingParams",
    "StrategyTraits",
    "VLLMRolloutEngine",
    "build_rollout_engine",
    "check_rollout_engine",
    "check_sampling_replay",
    "engine_traits",
    "eos_token_ids_of",
    "filter_logits",
    "kept_sets_recorded",
    "register_rollout_engine",
    "register_rollout_strategy",
    "rollout_log_probs_are_actors",
    "sample_next_tokens",
]
