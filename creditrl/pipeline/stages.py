"""The stages of a step that need no model: uids and seeds, the distillation teacher's inputs,
KL and distillation into rewards, DAPO shaping and filtering, mismatch metrics, rollout
importance weights, advantages. Each reads and writes named Batch fields (``READS`` /
``WRITES`` below; names from the field catalogue)."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import torch

from creditrl.batch import Batch, position_ids_from_mask
from creditrl.config import AlgorithmConfig, DistillConfig
from creditrl.core import (
    apply_kl_penalty,
    compute_advantage,
    compute_rollout_corr_metrics,
    compute_rollout_importance_weights,
    distill_term,
    last_valid_index,
    masked_mean,
)
from creditrl.usercode import resolve_adv_estimator

__all__ = [
    "add_sample_seeds",
    "add_uids",
    "apply_overlong_penalty",
    "compute_advantages",
    "distill_into_rewards",
    "kl_into_rewards",
    "mask_score_only_rows",
    "neutral_score_only_rows",
    "rollout_is_weights",
    "rollout_mismatch_metrics",
    "score_only_rows",
    "teacher_inputs",
    "varied_groups",
]


# What each stage reads and writes (catalogue field names); the pipeline composes them in
# spec 002's order (creditrl.pipeline.step).
READS: dict[str, tuple[str, ...]] = {
    "add_uids": (),
    "add_sample_seeds": ("uid",),
    "kl_into_rewards": ("token_level_scores", "old_log_probs", "ref_log_prob", "response_mask"),
    "teacher_inputs": (
        "prompts",
        "attention_mask",
        "responses",
        "response_mask",
        "teacher_prompt_ids",
    ),
    "distill_into_rewards": (
        "token_level_rewards",
        "token_level_scores",
        "old_log_probs",
        "teacher_log_prob",
        "response_mask",
    ),
    "apply_overlong_penalty": ("token_level_rewards", "response_mask"),
    "rollout_mismatch_metrics": ("old_log_probs", "rollout_log_probs", "response_mask"),
    "rollout_is_weights": ("old_log_probs", "rollout_log_probs", "response_mask"),
    "compute_advantages": ("token_level_rewards", "response_mask", "uid"),
    "varied_groups": ("token_level_scores", "uid"),
    "neutral_score_only_rows": ("num_turns", "old_log_probs"),
    "mask_score_only_rows": ("num_turns", "response_mask"),
}
WRITES: dict[str, tuple[str, ...]] = {
    "add_uids": ("uid",),
    "add_sample_seeds": ("sample_seed", "traj_id"),
    "kl_into_rewards": ("token_level_rewards",),
    "teacher_inputs": (),
    "distill_into_rewards": ("token_level_rewards",),
    "apply_overlong_penalty": ("token_level_rewards",),
    "rollout_mismatch_metrics": (),
    "rollout_is_weights": ("rollout_is_weights", "loss_mask"),
    "compute_advantages": ("advantages", "returns"),
    "varied_groups": (),
    "neutral_score_only_rows": ("rollout_log_probs", "ref_log_prob", "teacher_log_prob"),
    "mask_score_only_rows": ("response_mask", "loss_mask", "advantages", "rollout_is_weights"),
}


def add_uids(batch: Batch, rng: np.random.Generator) -> Batch:
    """One uid per prompt (``uid``), drawn from ``rng`` so resumed runs repeat them."""
    batch["uid"] = [str(uuid.UUID(int=int(rng.integers(0, 2**63)))) for _ in range(len(batch))]
    return batch


def add_sample_seeds(batch: Batch, rng: np.random.Generator) -> Batch:
    """One ``sample_seed`` per trajectory, drawn from ``rng`` (checkpointed with the run), and
    a stable ``traj_id`` = ``<uid>/<k>``, k the trajectory's place among its prompt's samples
    (rows sharing a uid, in the order of the repeat); it stays with the row through filtering
    and balancing, so a dumped row can be joined to its group and to the explain view."""
    batch["sample_seed"] = torch.from_numpy(rng.integers(0, 2**62, size=len(batch)))
    seen: dict[str, int] = {}
    ids = []
    for uid in batch["uid"]:
        k = seen.get(str(uid), 0)
        seen[str(uid)] = k + 1
        ids.append(f"{uid}/{k}")
    batch["traj_id"] = ids
    return batch


def apply_overlong_penalty(
    batch: Batch, cfg: AlgorithmConfig, max_response_length: int
) -> dict[str, float]:
    """DAPO overlong shaping, a per-token reward term: responses longer than L_max - L_buf get
    -penalty_factor * (len - (L_max - L_buf)) / L_buf added to ``token_level_rewards`` at
    their last valid token. ``token_level_scores`` (the task's score) is left as it is; run
    after ``kl_into_rewards``."""
    if not cfg.overlong_buffer.enable:
        return {}
    buf = cfg.overlong_buffer
    mask = batch["response_mask"]
    lengths = mask.sum(-1).float()
    expected = max_response_length - buf.len
    penalty = (-(lengths - expected) / buf.len * buf.penalty_factor).clamp(max=0.0)
    rewards = batch["token_level_rewards"]
    rows = torch.arange(len(batch))
    rewards[rows, last_valid_index(mask)] += penalty.to(rewards.dtype)
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


def _teacher_prompt(value: Any, vocab_size: int, max_length: int) -> list[int] | None:
    """``value`` as a teacher prompt (a list of 1..``max_length`` token ids below
    ``vocab_size``), or None when it is not one."""
    if not isinstance(value, list | tuple) or not 1 <= len(value) <= max_length:
        return None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return None
    return list(value) if all(0 <= t < vocab_size for t in value) else None


def teacher_inputs(
    batch: Batch, pad_token_id: int, vocab_size: int, max_length: int
) -> tuple[Batch, torch.Tensor]:
    """The distillation teacher's rows: its prompt (``teacher_prompt_ids`` when the batch holds
    them, else the student's own prompt ids) left-padded, then the student's ``responses``
    exactly as sampled (the same ids and response attention, never re-encoded), with
    ``position_ids`` and ``response_mask``; so column j of the teacher's log-probs scores
    y_{j+1}. Also (B,) bool: rows whose ``teacher_prompt_ids`` are not a list of 1..
    ``max_length`` ids below ``vocab_size`` (they come from a sampler in async runs); those
    rows are given the student's prompt here, and the caller gives them no term.
    """
    width = batch["prompts"].shape[1]
    student = [
        row[mask.bool()].tolist()
        for row, mask in zip(batch["prompts"], batch["attention_mask"][:, :width], strict=True)
    ]
    given = batch["teacher_prompt_ids"] if "teacher_prompt_ids" in batch else [None] * len(batch)
    checked = [_teacher_prompt(v, vocab_size, max_length) for v in given]
    rejected = torch.tensor(
        [v is None and g is not None for v, g in zip(checked, given, strict=True)], dtype=torch.bool
    )
    prompts = [c if c is not None else s for c, s in zip(checked, student, strict=True)]
    p = max(map(len, prompts))
    ids = torch.full((len(batch), p), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(batch), p), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, p - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, p - len(prompt) :] = 1
    attention = torch.cat([mask, batch["attention_mask"][:, width:].long()], dim=1)
    rows = Batch(
        {
            "input_ids": torch.cat([ids, batch["responses"].long()], dim=1),
            "attention_mask": attention,
            "position_ids": position_ids_from_mask(attention),
            "responses": batch["responses"],
            "response_mask": batch["response_mask"],
        }
    )
    return rows, rejected


def distill_into_rewards(batch: Batch, cfg: DistillConfig) -> dict[str, float]:
    """The distillation term d_t (``core.distill_term`` of ``teacher_log_prob`` and
    ``old_log_probs``, 0 where ``response_mask`` is 0) joins
    ``token_level_rewards``: ``combine=add`` adds coef * d_t; ``replace`` also takes the task's
    ``token_level_scores`` out (the KL penalty and later shaping stay). Run after
    ``kl_into_rewards``. Metrics: ``distill/reverse_kl`` (token mean of -d_t, the k1 estimate of
    KL(student || teacher)), ``distill/teacher_log_prob`` (token mean), ``distill/coef``."""
    mask = batch["response_mask"]
    d = distill_term(batch["teacher_log_prob"], batch["old_log_probs"], mask)
    rewards = batch["token_level_rewards"]
    if cfg.combine == "replace":
        rewards = rewards - batch["token_level_scores"].to(rewards.dtype)
    batch["token_level_rewards"] = rewards + cfg.coef * d.to(rewards.dtype)
    return {
        "distill/reverse_kl": float(masked_mean(-d, mask)),
        "distill/teacher_log_prob": float(masked_mean(batch["teacher_log_prob"], mask)),
        "distill/coef": float(cfg.coef),
    }


def rollout_is_weights(batch: Batch, cfg: AlgorithmConfig) -> dict[str, float]:
    """Rollout/training mismatch weights ``rollout_is_weights`` and, when the correction
    rejects tokens or vetoes sequences, ``loss_mask`` (``response_mask`` without them), when
    configured. Rejection acts in the losses only: ``response_mask``, the scores, rewards,
    advantages and returns (which define the trajectory) are not touched."""
    if not cfg.rollout_is.enable or "rollout_log_probs" not in batch:
        return {}
    is_cfg = cfg.rollout_is
    weights, loss_mask, metrics = compute_rollout_importance_weights(
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
    if is_cfg.mode == "mask" or is_cfg.veto_threshold is not None:
        batch["loss_mask"] = loss_mask.to(batch["response_mask"].dtype)
    return metrics


def rollout_mismatch_metrics(batch: Batch) -> dict[str, float]:
    """``rollout_corr/*`` (sampler vs trainer log-probs) whenever the batch holds rollout
    log-probs and ``old_log_probs`` the trainer recomputed. When the old log-probs are the
    rollout's own (equal tensors: nothing to compare here), the actor reports the same keys
    from its first mini-batch's training forward instead."""
    if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
        return {}
    if torch.equal(batch["old_log_probs"], batch["rollout_log_probs"]):
        return {}
    return compute_rollout_corr_metrics(
        batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
    )


def compute_advantages(batch: Batch, cfg: AlgorithmConfig) -> None:
    """``advantages`` and ``returns`` by the configured estimator."""
    adv, returns = compute_advantage(
        resolve_adv_estimator(cfg.adv_estimator),
        batch["token_level_rewards"],
        batch["response_mask"],
        batch.get("uid"),
        values=batch.get("values"),
        token_level_scores=batch.get("token_level_scores"),
        reward_baselines=batch.get("reward_baselines"),
        turn_scores=batch.get("turn_scores"),
        global_scores=batch.get("global_scores"),
        gamma=cfg.gamma,
        lam=cfg.lam,
        norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo,
    )
    batch["advantages"] = adv
    batch["returns"] = returns


def score_only_rows(batch: Batch) -> torch.Tensor:
    """(B,) bool: rows that carry a score and no trained token, the agent episodes that
    recorded no model turn (``num_turns`` 0: one placeholder response token with mask 1,
    ``creditrl.agents.rollout.trajectories_to_batch``). All False for other batches."""
    if "num_turns" not in batch:
        return torch.zeros(len(batch), dtype=torch.bool)
    return batch["num_turns"].cpu() == 0


def neutral_score_only_rows(batch: Batch) -> None:
    """The placeholder was never sampled: its rollout, reference and teacher log-probs become
    the old ones, so the KL penalty, the distillation term, the mismatch metrics and the
    importance weights see ratio 1 and KL 0 there and the score-only rows keep exactly their
    score. Run before the KL stage."""
    rows = score_only_rows(batch)
    if not bool(rows.any()):
        return
    old = batch["old_log_probs"]
    for key in ("rollout_log_probs", "ref_log_prob", "teacher_log_prob"):
        if key in batch:
            batch[key][rows] = old[rows].to(batch[key].dtype)


def mask_score_only_rows(batch: Batch) -> None:
    """Score-only rows out of every update: ``response_mask``, ``loss_mask``, ``advantages``
    and ``rollout_is_weights`` 0 on them. Run after the advantages (which counted their
    score in their group) and before the critic and actor updates."""
    rows = score_only_rows(batch)
    if not bool(rows.any()):
        return
    for key in ("response_mask", "loss_mask", "advantages", "rollout_is_weights"):
        if key in batch:
            batch[key][rows] = 0
