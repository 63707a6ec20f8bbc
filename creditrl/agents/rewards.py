"""The structured multi-turn reward manager (spec 001) and the trajectory score of step 6.

Per sample, a structured scorer chosen by ``data_source`` (exact name, then its "/"-prefixes;
``STRUCTURED_SCORERS``) returns ``turn_rewards {turn: r}`` and ``global_rewards {name: r}``
(keys starting ``_`` logged only). Then, per sample i,

    total_score_i = mean_k turn_rewards_ik + sum_(counted names) global_rewards_i

(``creditrl.core.total_score``), and ``token_level_scores`` come from
``creditrl.core.structured_to_token_level`` with ``agent.reward_distribution``
(``final_token_only``: the total on the last policy token; ``turn_proportional``: each turn's
reward spread over its policy tokens, the global sum over all policy tokens). Only tokens with
``response_mask`` 1 receive reward, so observation tokens get none.

A data_source without a structured scorer uses its ordinary rule scorer
(``creditrl.rewards.get_scorer``) on the decoded policy tokens, as one global reward ``score``.
Scoring runs in this process (the scorers are cheap string functions); a scorer that raises
gives ``reward.fallback_score`` as a global reward, with status ``error`` and the message.

Tool-use outcome metrics (``tool_use_metrics``; per-sample values in the rollout dump too):
``agent/called_tool``, the share of trajectories with at least one successful tool call
(status ``ok``), and ``agent/tool_then_correct``, the share that made one and whose final
answer is correct (the scorer's ``_raw_exact_match`` global is 1; logged only when a scorer
reports it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from creditrl.agents.task_rewards import (
    AgentSample,
    calc_structured_reward,
    kgqa_structured_reward,
)
from creditrl.batch import Batch
from creditrl.config.schema import AgentConfig, RewardConfig
from creditrl.core import REWARD_DISTRIBUTIONS, structured_to_token_level, total_score
from creditrl.rewards.failures import check_failure_rate
from creditrl.rewards.manager import RewardResult
from creditrl.rewards.registry import get_scorer
from creditrl.rewards.text import decode_responses

__all__ = [
    "STRUCTURED_SCORERS",
    "StructuredRewardManager",
    "StructuredRewardResult",
    "add_trajectory_scores",
    "register_structured_scorer",
    "structured_scorer_for",
    "tool_use_metrics",
    "trajectory_scores",
]

log = logging.getLogger(__name__)

StructuredScorer = Callable[..., Mapping[str, Any]]
STRUCTURED_SCORERS: dict[str, StructuredScorer] = {
    "kgqa": kgqa_structured_reward,
    "calc_multiturn": calc_structured_reward,
}


def register_structured_scorer(name: str) -> Callable[[StructuredScorer], StructuredScorer]:
    """Decorator: ``fn(sample: AgentSample, **reward.scorer_kwargs)`` scores ``name``."""

    def deco(fn: StructuredScorer) -> StructuredScorer:
        STRUCTURED_SCORERS[name] = fn
        return fn

    return deco


def structured_scorer_for(data_source: str) -> StructuredScorer | None:
    """The structured scorer of ``data_source`` (exact, then "/"-prefixes), or None."""
    parts = data_source.split("/")
    for cut in range(len(parts), 0, -1):
        name = "/".join(parts[:cut])
        if name in STRUCTURED_SCORERS:
            return STRUCTURED_SCORERS[name]
    return None


def _called_tool(calls: Any) -> bool:
    return any(str(c.get("status")) == "ok" for c in calls or [])


def tool_use_metrics(
    tool_calls: list[Any], global_rewards: list[Mapping[str, float]]
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """(``agent/called_tool`` and ``agent/tool_then_correct`` batch shares, their per-sample
    0/1 values) from each trajectory's tool-call records and global rewards; see the module
    doc. ``tool_then_correct`` is left out when no sample reports ``_raw_exact_match``."""
    size = max(len(tool_calls), 1)
    called = [float(_called_tool(calls)) for calls in tool_calls]
    metrics = {"agent/called_tool": sum(called) / size}
    per_sample = {"called_tool": called}
    if any("_raw_exact_match" in g for g in global_rewards):
        correct = [float(g.get("_raw_exact_match", 0.0) >= 1.0) for g in global_rewards]
        both = [c * e for c, e in zip(called, correct, strict=True)]
        metrics["agent/tool_then_correct"] = sum(both) / size
        per_sample["tool_then_correct"] = both
    return metrics, per_sample


def trajectory_scores(returns: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Spec 001 step 6, the score saved with a trajectory: s_i = sum_t returns_it * m_it
    (m = ``response_mask``: policy tokens with state masking, all response tokens without).
    1-D ``returns`` are already per sample and are returned as they are."""
    if returns.dim() == 1:
        return returns.float()
    return (returns * loss_mask.to(returns.dtype)).sum(-1).float()


def add_trajectory_scores(batch: Batch) -> None:
    """Set ``trajectory_score`` (B,) from ``returns`` and ``response_mask`` and list it among
    the fields the rollout dump shows (``meta["reward_extra_keys"]``)."""
    if "returns" not in batch:
        return
    batch["trajectory_score"] = trajectory_scores(batch["returns"], batch["response_mask"])
    keys = list(batch.meta.get("reward_extra_keys", []))
    if "trajectory_score" not in keys:
        batch.meta["reward_extra_keys"] = [*keys, "trajectory_score"]


@dataclass
class StructuredRewardResult(RewardResult):
    """A RewardResult with the structured parts: ``structured`` (per-sample dicts),
    ``turn_scores`` (B,) = mean turn reward, ``global_scores`` (B,) = counted global sum."""

    structured: list[dict[str, Any]] = field(default_factory=list)
    turn_scores: torch.Tensor | None = None
    global_scores: torch.Tensor | None = None

    def write_to(self, batch: Batch) -> None:
        """Also sets ``structured_rewards``, ``turn_scores`` and ``global_scores``."""
        super().write_to(batch)
        batch["structured_rewards"] = [
            {**s, "turn_rewards": {str(t): r for t, r in s.get("turn_rewards", {}).items()}}
            for s in self.structured
        ]  # turn numbers as strings: batches travel as JSON between processes
        batch["turn_scores"] = self.turn_scores
        batch["global_scores"] = self.global_scores


class _Ready:
    """An already computed result with the RewardFuture interface."""

    def __init__(self, result: StructuredRewardResult) -> None:
        self._result = result

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> StructuredRewardResult:
        return self._result


def _counted_sum(rewards: Mapping[str, float]) -> float:
    return float(sum(v for k, v in rewards.items() if not str(k).startswith("_")))


def _column(batch: Batch, name: str, default: Any) -> list[Any]:
    return list(batch[name]) if name in batch else [default] * len(batch)


class StructuredRewardManager:
    """Spec 001 rewards for agent rollouts; the trainer uses it like ``RewardManager``
    (``submit(batch).result()``, ``__call__``, ``close``)."""

    def __init__(self, reward_cfg: RewardConfig, agent_cfg: AgentConfig, tokenizer: Any) -> None:
        if agent_cfg.reward_distribution not in REWARD_DISTRIBUTIONS:
            raise ValueError(
                f"agent.reward_distribution must be one of {REWARD_DISTRIBUTIONS}, "
                f"got {agent_cfg.reward_distribution!r}"
            )
        self.cfg = reward_cfg
        self.distribution = agent_cfg.reward_distribution
        self.tokenizer = tokenizer

    def submit(self, batch: Batch) -> _Ready:
        """Score ``batch`` now; returns a finished future."""
        return _Ready(self.score(batch))

    def __call__(self, batch: Batch) -> StructuredRewardResult:
        return self.score(batch)

    def close(self) -> None:
        """Nothing to release (scoring runs in this process)."""

    def _sample(self, batch: Batch, i: int, text: str) -> AgentSample:
        info = _column(batch, "agent_info", None)[i] or {}
        turns = info.get("turns") or [{"turn": 1, "text": text, "answer": None}]
        return AgentSample(
            data_source=str(batch["data_source"][i]),
            ground_truth=_column(batch, "ground_truth", None)[i],
            turns=list(turns),
            tool_calls=list(_column(batch, "tool_calls", [])[i] or []),
            extra_info=dict(_column(batch, "extra_info", {})[i] or {}),
            stop_reason=str(info.get("stop_reason", "")),
        )

    def _score_one(self, batch: Batch, i: int, text: str) -> tuple[dict[str, Any], str | None]:
        source = str(batch["data_source"][i])
        kwargs = dict(self.cfg.scorer_kwargs)
        scorer = None if self.cfg.scorer else structured_scorer_for(source)
        try:
            if scorer is not None:
                out = dict(scorer(self._sample(batch, i, text), **kwargs))
            else:
                rule = get_scorer(source, self.cfg.scorer)
                infos = _column(batch, "extra_info", {})
                value = rule(source, text, batch["ground_truth"][i], infos[i], **kwargs)
                score = value["score"] if isinstance(value, Mapping) else value
                out = {"turn_rewards": {}, "global_rewards": {"score": float(score)}}
            out.setdefault("turn_rewards", {})
            out.setdefault("global_rewards", {})
            values = [*out["turn_rewards"].values(), *out["global_rewards"].values()]
            if not all(math.isfinite(float(v)) for v in values):
                raise ValueError(f"non-finite reward in {out}")
            return out, None
        except Exception as e:
            fallback = {"turn_rewards": {}, "global_rewards": {"score": self.cfg.fallback_score}}
            return fallback, f"{type(e).__name__}: {e}"

    def score(self, batch: Batch) -> StructuredRewardResult:
        """Structured rewards, totals and token-level scores of every sample."""
        texts = decode_responses(batch, self.tokenizer)
        outs, errors = zip(
            *(self._score_one(batch, i, t) for i, t in enumerate(texts)), strict=True
        )
        turn_rewards = [{int(k): float(v) for k, v in o["turn_rewards"].items()} for o in outs]
        global_rewards = [{str(k): float(v) for k, v in o["global_rewards"].items()} for o in outs]
        mask = batch["response_mask"].cpu()
        turn_ids = batch["turn_ids"].cpu() if "turn_ids" in batch else mask.long()
        token_level = structured_to_token_level(
            turn_rewards, global_rewards, mask, turn_ids, self.distribution
        ).float()
        totals = torch.tensor(
            [total_score(t, g) for t, g in zip(turn_rewards, global_rewards, strict=True)],
            dtype=torch.float32,
        )
        turn_means = torch.tensor(
            [sum(t.values()) / len(t) if t else 0.0 for t in turn_rewards], dtype=torch.float32
        )
        global_sums = torch.tensor([_counted_sum(g) for g in global_rewards], dtype=torch.float32)
        extra: dict[str, list[Any]] = {
            "reward_status": ["error" if e else "ok" for e in errors],
            "reward_error": list(errors),
            "turn_reward_mean": turn_means.tolist(),
            "global_reward_sum": global_sums.tolist(),
        }
        names = sorted({k for g in global_rewards for k in g})
        for name in names:
            extra[name] = [g.get(name) for g in global_rewards]
        failures = [(i, e) for i, e in enumerate(errors) if e]
        if failures:
            log.warning(
                "%d structured reward failures; first: sample %d: %s", len(failures), *failures[0]
            )
        sources = batch["data_source"]
        check_failure_rate(
            [f"sample {i} (data_source {str(sources[i])!r}): {e}" for i, e in failures],
            len(errors),
            self.cfg.max_failure_rate,
        )
        metrics = {
            "reward/errors": float(len(failures)),
            "reward/score_mean": float(totals.mean()),
            "reward/score_min": float(totals.min()),
            "reward/score_max": float(totals.max()),
            "reward/turn_reward_mean": float(turn_means.mean()),
            "reward/global_reward_sum_mean": float(global_sums.mean()),
        }
        for name in names:
            values = [v for v in extra[name] if v is not None]
            metrics[f"reward/{name}_mean"] = sum(values) / len(values)
        if "tool_calls" in batch:
            tool_metrics, per_sample = tool_use_metrics(list(batch["tool_calls"]), global_rewards)
            metrics.update(tool_metrics)
            extra.update(per_sample)
        structured = [
            {"turn_rewards": t, "global_rewards": g, "total_score": float(s)}
            for t, g, s in zip(turn_rewards, global_rewards, totals.tolist(), strict=True)
        ]
        return StructuredRewardResult(
            token_level_scores=token_level,
            scores=totals,
            extra=extra,
            metrics=metrics,
            structured=structured,
            turn_scores=turn_means,
            global_scores=global_sums,
        )
