"""Rewards: rule scorers by data_source, the reward manager (worker processes), reward models.

- ``registry``: ``get_scorer(data_source, override)``, ``register_scorer``, user "file.py:fn"
  (loaded by ``creditrl.usercode``, its signature checked by ``check_scorer_signature``).
- ``failures``: ``ScoringError`` when more than ``reward.max_failure_rate`` of a step fails.
- ``scorers``: built-ins "reasoning_gym", "gsm8k" (spec 003), "math" (math_verify).
- ``manager``: ``RewardManager(cfg, tokenizer).submit(batch) -> RewardFuture``.
- ``worker``: the ``python -m creditrl.rewards.worker`` JSON-lines scoring process.
- ``reward_model``: ``RewardModelWorker`` (sequence classifier -> rm_scores).

The manager and reward model (torch, transformers) load on first attribute access, so a scoring
worker imports only what it needs.
"""

from __future__ import annotations

from typing import Any

from creditrl.rewards.failures import ScoringError, check_failure_rate
from creditrl.rewards.registry import (
    BUILTIN_SCORERS,
    SCORER_SIGNATURE,
    SCORERS,
    Scorer,
    check_scorer_signature,
    get_scorer,
    load_scorer_file,
    register_scorer,
    scorer_spec,
)

__all__ = [
    "BUILTIN_SCORERS",
    "SCORERS",
    "SCORER_SIGNATURE",
    "RewardFuture",
    "RewardManager",
    "RewardModelWorker",
    "RewardResult",
    "Scorer",
    "ScoringError",
    "check_failure_rate",
    "check_scorer_signature",
    "get_scorer",
    "load_scorer_file",
    "register_scorer",
    "scorer_spec",
]

_LAZY = {
    "RewardFuture": "creditrl.rewards.manager",
    "RewardManager": "creditrl.rewards.manager",
    "RewardResult": "creditrl.rewards.manager",
    "RewardModelWorker": "creditrl.rewards.reward_model",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
