"""What the trainer does with an agent batch after its step: metrics, drift checks, scores.

``after_step(batch, tokenizer, cfg)`` (one call in the trainer's step, before the rollout dump)
returns the ``tools/*``, ``num_turns/*``, ``agent/*`` and ``tokenization/*`` metrics, writes the
drift reports of the checked rows into ``tokenization_drift`` and the spec 001 step 6 score into
``trajectory_score``, both shown by the rollout dump.
"""

from __future__ import annotations

import functools
from typing import Any

from creditrl.agents.chat import ChatFormat
from creditrl.agents.drift import DRIFT_FIELD, check_batch
from creditrl.agents.rewards import add_trajectory_scores
from creditrl.agents.rollout import agent_metrics
from creditrl.batch import Batch
from creditrl.config.schema import AgentConfig

__all__ = ["after_step", "chat_format"]


@functools.lru_cache(maxsize=8)
def chat_format(tokenizer: Any, tool_role: str = "tool") -> ChatFormat:
    """One ChatFormat per tokenizer (tokenizers are shared, cached objects)."""
    return ChatFormat(tokenizer, tool_role)


def after_step(batch: Batch, tokenizer: Any, cfg: AgentConfig) -> dict[str, float]:
    """Agent metrics of ``batch`` and its drift checks (``cfg.drift_check_rows`` rows, spread
    over the batch); sets ``tokenization_drift`` and ``trajectory_score``."""
    metrics = agent_metrics(batch) if "tool_calls" in batch else {}
    if cfg.drift_check_rows > 0:
        drift, reports = check_batch(
            batch, chat_format(tokenizer, cfg.tool_role), cfg.drift_check_rows
        )
        batch[DRIFT_FIELD] = reports
        metrics.update(drift)
    add_trajectory_scores(batch)
    return metrics
