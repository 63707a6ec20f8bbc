"""Rewards onto tokens: where a sequence's score lands, how structured multi-turn rewards
(spec 001) spread over turns, and the KL penalty that turns scores into rewards.

Index convention: column j of a (B, T) response tensor is step t = j + 1; the reward of
column j is for the transition made by token y_{j+1} (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from creditrl.core.kl import kl_penalty as kl_estimate
from creditrl.core.masked import masked_mean
from creditrl.core.registries import REWARD_DISTRIBUTIONS

__all__ = [
    "REWARD_DISTRIBUTIONS",
    "apply_kl_penalty",
    "last_valid_index",
    "place_sequence_scores",
    "structured_to_token_level",
    "total_score",
]


def last_valid_index(response_mask: torch.Tensor) -> torch.Tensor:
    """(B,) column of each row's last valid response token; ValueError naming empty rows."""
    m = response_mask.bool()
    empty = (~m.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"samples {empty[:10]} have no valid response token to put a score on")
    cols = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m, cols, -1).amax(dim=1)


def place_sequence_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """token_level_scores (B, T): score_i on row i's last valid response token, 0 elsewhere.

    score_t = s_i if t = T_i (the last t with mask 1), else 0. NaN or inf scores raise,
    naming the samples.
    """
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"sequence scores are NaN or inf for samples {bad[:10]}")
    out = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    rows = torch.arange(out.shape[0], device=out.device)
    out[rows, last_valid_index(response_mask)] = scores
    return out


def _counted(global_rewards: Mapping[str, float]) -> float:
    """Sum of global rewards; keys starting with '_' are for logs only and are not counted."""
    return float(sum(v for k, v in global_rewards.items() if not k.startswith("_")))


def total_score(turn_rewards: Mapping[int, float], global_rewards: Mapping[str, float]) -> float:
    """Spec 001's total: mean of the turn rewards (0 with no turns) + sum of global rewards."""
    turn_mean = sum(turn_rewards.values()) / len(turn_rewards) if turn_rewards else 0.0
    return turn_mean + _counted(global_rewards)


def structured_to_token_level(
    turn_rewards: Sequence[Mapping[int, float]],
    global_rewards: Sequence[Mapping[str, float]],
    response_mask: torch.Tensor,
    turn_ids: torch.Tensor,
    distribution: str = "final_token_only",
) -> torch.Tensor:
    """Structured per-sample rewards (spec 001) as token_level_scores (B, T).

    - ``turn_proportional``: turn k's reward R_k is split evenly over its tokens,
      R_k / |{t: turn_t = k, m_t = 1}|; the counted global sum G over all valid tokens, G / n.
    - ``final_token_only``: mean_k R_k + G on the last valid token.

    Only tokens with response_mask 1 (the policy's own) receive reward; observation tokens get
    none. A turn reward for a turn with no such token raises ValueError naming sample and turn.
    """
    if distribution not in REWARD_DISTRIBUTIONS:
        raise ValueError(
            f"unknown reward distribution {distribution!r}; choose {REWARD_DISTRIBUTIONS}"
        )
    batch = response_mask.shape[0]
    if len(turn_rewards) != batch or len(global_rewards) != batch:
        raise ValueError(
            f"got {len(turn_rewards)} turn and {len(global_rewards)} global reward dicts "
            f"for a batch of {batch}"
        )
    mask = response_mask.to(torch.float32)
    if distribution == "final_token_only":
        totals = torch.tensor(
            [total_score(t, g) for t, g in zip(turn_rewards, global_rewards, strict=True)]
        )
        return place_sequence_scores(totals, response_mask)

    turns = (turn_ids.long() * response_mask.long()).clamp(min=0)
    n_turns = int(turns.max().item()) + 1 if turns.numel() else 1
    n_turns = max(n_turns, 1 + max((max(t, default=0) for t in turn_rewards), default=0))
    per_turn = torch.zeros(batch, n_turns)
    for i, rewards in enumerate(turn_rewards):
        for k, value in rewards.items():
            per_turn[i, int(k)] = float(value)
    counts = torch.zeros(batch, n_turns).scatter_add_(1, turns, mask)
    counts[:, 0] = 0.0
    missing = ((per_turn != 0) & (counts == 0)).nonzero().tolist()
    if missing:
        i, k = missing[0]
        raise ValueError(f"sample {i}: turn {k} has a reward but no policy token to carry it")
    share = per_turn / counts.clamp(min=1.0)
    out = share.gather(1, turns) * mask
    globals_ = torch.tensor([_counted(g) for g in global_rewards])
    out += (globals_ / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1) * mask
    return out


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kl_penalty: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """token_level_rewards = token_level_scores - beta * kl_t * m_t (KL in the reward).

    kl_t is the named estimator of (old_log_probs, ref_log_prob) at step t. Also returns the
    batch KL (mean over samples of each sample's token-mean kl), which an adaptive controller
    consumes, and beta.
    """
    kld = kl_estimate(old_log_probs, ref_log_prob, kl_penalty) * response_mask
    rewards = token_level_scores - kl_coef * kld
    current_kl = masked_mean(kld, response_mask, dim=-1).mean()
    return rewards, {
        "actor/reward_kl_penalty": float(current_kl),
        "actor/reward_kl_penalty_coeff": float(kl_coef),
    }
