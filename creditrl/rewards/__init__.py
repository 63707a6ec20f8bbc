"""Rewards: rule scorers by data_source, the reward manager (worker processes), reward models.

- ``registry``: ``get_scorer(data_source, override)``, ``register_scorer``, user "file.py:fn".
- ``scorers``: built-ins "reasoning_gym", "gsm8k" (spec 003), "math" (math_verify).
- ``manager``: ``RewardManager(cfg, tokenizer).submit(batch) -> RewardFuture``.
- ``worker``: the ``python -m creditrl.rewards.worker`` JSON-lines scoring process.
- ``reward_model``: ``RewardModelWorker`` (sequence classifier -> rm_scores).

The manager and reward model (torch, transformers) load on first attribute access, so a scoring
worker imports only what it needs.
"""

from __future__ import annotations

from typing import Any

from creditrl.rewards.registry import (
    BUILTIN_SCORERS,
    SCORERS,
    Scorer,
    get_scorer,
    load_scorer_file,
    register_scorer,
    scorer_spec,
)

__all__ = [
    "BUILTIN_SCORERS",
    "SCORERS",
    "RewardFuture",
    "RewardManager",
    "RewardModelWorker",
    "RewardResult",
    "Scorer",
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
