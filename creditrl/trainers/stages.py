"""Batch-level stages of a step that need no model: uids, KL into rewards, DAPO shaping and
filtering, rollout importance weights, advantages. Each reads and writes named Batch fields."""

from __future__ import annotations

import uuid

import numpy as np
import torch

from creditrl.batch import Batch
from creditrl.config import AlgorithmConfig
from creditrl.core import (
    apply_kl_penalty,
    compute_advantage,
    compute_rollout_importance_weights,
)

__all__ = [
    "add_sample_seeds",
    "add_uids",
    "apply_overlong_penalty",
    "compute_advantages",
    "kl_into_rewards",
    "merge",
    "rollout_is_weights",
    "varied_groups",
]


def add_uids(batch: Batch, rng: np.random.Generator) -> Batch:
    """One uid per prompt (``uid``), drawn from ``rng`` so resumed runs repeat them."""
    batch["uid"] = [str(uuid.UUID(int=int(rng.integers(0, 2**63)))) for _ in range(len(batch))]
    return batch


def add_sample_seeds(batch: Batch, rng: np.random.Generator) -> Batch:
    """One ``sample_seed`` per trajectory, drawn from ``rng`` (checkpointed with the run)."""
    batch["sample_seed"] = torch.from_numpy(rng.integers(0, 2**62, size=len(batch)))
    return batch


def merge(batch: Batch, new: Batch) -> Batch:
    """Add (or replace) ``new``'s fields in ``batch``, in place; the rows must correspond."""
    if len(new) != len(batch):
        raise ValueError(f"a worker returned {len(new)} rows for a batch of {len(batch)}")
    fields = new.keys()
    for key in fields:
        batch[key] = new[key]
    return batch


def apply_overlong_penalty(
    batch: Batch, cfg: AlgorithmConfig, max_response_length: int
) -> dict[str, float]:
    """DAPO overlong shaping: responses longer than L_max - L_buf lose
    penalty_factor * (len - (L_max - L_buf)) / L_buf on their last token's score."""
    if not cfg.overlong_buffer.enable:
        return {}
    buf = cfg.overlong_buffer
    lengths = batch["response_mask"].sum(-1).float()
    expected = max_response_length - buf.len
    penalty = (-(lengths - expected) / buf.len * buf.penalty_factor).clamp(max=0.0)
    scores = batch["token_level_scores"]
    last = torch.where(batch["response_mask"].bool(), torch.arange(scores.shape[1]), -1).amax(-1)
    scores[torch.arange(len(batch)), last] += penalty.to(scores.dtype)
    return {"reward/overlong_penalty_mean": float(penalty.mean())}


def varied_groups(batch: Batch) -> np.ndarray:
    """Boolean per sample: its uid group's sequence scores are not all equal (DAPO filter)."""
    scores = batch["token_level_scores"].sum(-1).numpy()
    uids = np.asarray(batch["uid"]).astype(str)
    keep = np.zeros(len(uids), dtype=bool)
    for uid in np.unique(uids):
        members = uids == uid
        keep[members] = np.ptp(scores[members]) > 0
    return keep


def kl_into_rewards(batch: Batch, cfg: AlgorithmConfig, kl_coef: float) -> dict[str, float]:
    """token_level_rewards = scores - beta * kl (when ``use_kl_in_reward``), else the scores."""
    scores = batch["token_level_scores"]
    if not cfg.use_kl_in_reward:
        batch["token_level_rewards"] = scores.clone()
        return {}
    rewards, metrics = apply_kl_penalty(
        scores,
        batch["old_log_probs"],
        batch["ref_log_prob"],
        batch["response_mask"],
        kl_coef,
        cfg.kl_penalty,
    )
    batch["token_level_rewards"] = rewards
    return metrics


def rollout_is_weights(batch: Batch, cfg: AlgorithmConfig) -> dict[str, float]:
    """Rollout/training mismatch weights (and rejection mask) when configured."""
    if not cfg.rollout_is.enable or "rollout_log_probs" not in batch:
        return {}
    is_cfg = cfg.rollout_is
    weights, mask, metrics = compute_rollout_importance_weights(
        batch["old_log_probs"],
        batch["rollout_log_probs"],
        batch["response_mask"],
        rollout_is_level=is_cfg.level,
        rollout_is_mode=is_cfg.mode,
        rollout_is_threshold=is_cfg.threshold,
        rollout_is_threshold_lower=is_cfg.threshold_lower,
        rollout_is_veto_threshold=is_cfg.veto_threshold,
    )
    batch["rollout_is_weights"] = weights
    batch["response_mask"] = mask.to(batch["response_mask"].dtype)
    return metrics


def compute_advantages(batch: Batch, cfg: AlgorithmConfig) -> None:
    """``advantages`` and ``returns`` by the configured estimator."""
    adv, returns = compute_advantage(
        cfg.adv_estimator,
        batch["token_level_rewards"],
        batch["response_mask"],
        batch.get("uid"),
        values=batch.get("values"),
        reward_baselines=batch.get("reward_baselines"),
        turn_scores=batch.get("turn_scores"),
        global_scores=batch.get("global_scores"),
        gamma=cfg.gamma,
        lam=cfg.lam,
        norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
    )
    batch["advantages"] = adv
    batch["returns"] = returns
