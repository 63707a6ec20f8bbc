"""Rollout engines: sample responses (token ids, masks, log-probs) for a prompt Batch."""

from creditrl.rollout.factory import build_rollout_engine
from creditrl.rollout.hf_engine import HFRolloutEngine, SamplingParams, eos_token_ids_of
from creditrl.rollout.sampling import filter_logits, sample_next_tokens

__all__ = [
    "HFRolloutEngine",
    "SamplingParams",
    "build_rollout_engine",
    "eos_token_ids_of",
    "filter_logits",
    "sample_next_tokens",
]
