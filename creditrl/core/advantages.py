"""Advantage estimators: every one returns ``(advantages, returns)``, each (B, T), zero where
``response_mask`` is 0. Select one by name with ``get_advantage_estimator``.

Index convention (docs/architecture.md): column j is step t = j + 1; ``values[:, j]`` = V(s_t);
``token_level_rewards[:, j]`` = r_t. Positions with mask 0 inside a response (tool output)
are not time steps: credit passes through them to the previous model token.

Group estimators take ``index`` (one uid per sample; samples of one prompt share it) and
compute group statistics with scatter ops, not loops over samples. A sample alone in its
group has no baseline to compare with and gets advantage 0 in every group estimator (verl
keeps the raw score there for some estimators; we do not).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from creditrl.core.masked import masked_whiten, row_blocks
from creditrl.core.registries import (
    ADV_ESTIMATORS,
    get_advantage_estimator,
    register_adv_est,
)
from creditrl.core.scan import compact, discounted_suffix_sum, is_right_padded, uncompact

__all__ = [
    "ADV_ESTIMATORS",
    "compute_advantage",
    "compute_gae_advantage_return",
    "get_advantage_estimator",
    "register_adv_est",
]

AdvFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Index = Sequence[Any] | np.ndarray | torch.Tensor


def compute_advantage(
    adv_estimator: str,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Check inputs, then run the named estimator. ``options`` holds the estimator's settings
    (``values``, ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo``, ``reward_baselines``, ...);
    settings an estimator does not use are ignored, so one config drives them all."""
    _check_inputs(token_level_rewards, response_mask, index)
    fn = get_advantage_estimator(adv_estimator)
    kwargs = {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "index": index,
        **options,
    }
    takes = _parameters(fn)
    if takes is not None:
        kwargs = {name: value for name, value in kwargs.items() if name in takes}
    return fn(**kwargs)


@functools.cache
def _parameters(fn: AdvFn) -> frozenset[str] | None:
    """The keyword names ``fn`` takes, or None when it takes ``**kwargs`` (it gets them all)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)


def _check_inputs(rewards: torch.Tensor, mask: torch.Tensor, index: Index | None) -> None:
    if rewards.shape != mask.shape or rewards.dim() != 2:
        raise ValueError(
            f"token_level_rewards {tuple(rewards.shape)} and response_mask {tuple(mask.shape)} "
            "must both be (B, T)"
        )
    bad = (~torch.isfinite(rewards) & mask.bool()).any(dim=1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"token_level_rewards has NaN or inf in samples {bad[:10]}")
    if index is not None and len(index) != rewards.shape[0]:
        raise ValueError(f"index has {len(index)} uids for a batch of {rewards.shape[0]}")


def _suffix_sum_over_valid(x: torch.Tensor, mask: torch.Tensor, c: float) -> torch.Tensor:
    """y_t = x_t + c * y_{t'} where t' is the next valid step after t (0 after the last), at
    valid steps; 0 at masked positions. Masked positions neither count nor break the chain."""
    if is_right_padded(mask):
        return discounted_suffix_sum(x * mask, c) * mask
    return uncompact(discounted_suffix_sum(compact(x, mask), c), mask)


def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    *,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), mask-aware.

    Over the valid steps t_1 < ... < t_n of a row (V_{n+1} = 0):
        delta_k = r_k + gamma V_{k+1} - V_k
        A_k     = delta_k + gamma lam A_{k+1}
        R_k     = A_k + V_k                       (returns, from the raw A)
    then ``advantages = masked_whiten(A) * mask`` (``whiten=False`` keeps the raw A).
    Steps with mask 0 (observations) are skipped: the step after a model token is the next
    model token, so GAE across a masked span equals GAE with the span removed.
    """
    mask = response_mask
    if is_right_padded(mask):
        adv, returns = _gae_raw(token_level_rewards, values, mask, gamma, lam)
    else:
        mask = mask.to(token_level_rewards.dtype)
        valid = compact(mask, mask)
        adv, returns = _gae_raw(
            compact(token_level_rewards, mask), compact(values, mask), valid, gamma, lam
        )
        adv, returns = uncompact(adv, mask), uncompact(returns, mask)
    if whiten:
        masked_whiten(adv, mask, inplace=True).mul_(mask)
    return adv, returns


def _gae_raw(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GAE on right-padded rows, by row blocks with in-place steps (see row_blocks)."""
    adv, returns = torch.empty_like(rewards), torch.empty_like(rewards)
    for rows in row_blocks(*rewards.shape):
        m = mask[rows].to(rewards.dtype)
        vals = values[rows] * m
        deltas = F.pad(vals[:, 1:], (0, 1)).mul_(gamma).add_(rewards[rows]).sub_(vals).mul_(m)
        block = discounted_suffix_sum(deltas, gamma * lam, out=adv[rows]).mul_(m)
        torch.add(vals, block, out=returns[rows])
    return adv, returns


def _gae(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE through the common estimator signature; needs ``values`` from the critic."""
    if values is None:
        raise ValueError("adv_estimator 'gae' needs `values` (B, T) from the critic")
    return compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam)


def _group_ids(index: Index | None, batch: int, estimator: str) -> tuple[torch.Tensor, int]:
    """Dense group ids 0..G-1 for the uids in ``index``."""
    if index is None:
        raise ValueError(f"adv_estimator {estimator!r} needs `index` (one uid per sample)")
    if isinstance(index, torch.Tensor):
        uniq, inverse = torch.unique(index, return_inverse=True)
        return inverse.long(), len(uniq)
    uniq, inverse = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.from_numpy(inverse.reshape(-1)).long(), len(uniq)


def _group_stats(
    scores: torch.Tensor, gid: torch.Tensor, n_groups: int, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: its group's size n, (weighted) mean, and unbiased std (0 when n = 1).

    mean_g = sum_i w_i s_i / sum_i w_i (w = 1 unless given); std_g = sqrt(sum_i (s_i - mean_g)^2
    / (n_g - 1)). Computed in float64.
    """
    s = scores.double()
    w = torch.ones_like(s) if weights is None else weights.double()
    zeros = torch.zeros(n_groups, dtype=torch.float64, device=s.device)
    count = torch.bincount(gid, minlength=n_groups).to(torch.float64)
    mean = zeros.index_add(0, gid, w * s) / zeros.index_add(0, gid, w).clamp(min=1e-30)
    sq = zeros.index_add(0, gid, (s - mean[gid]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return count[gid], mean[gid], std[gid]


def _outcome_scores(token_level_rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i = sum_t r_it m_it: the sequence's outcome score."""
    return (token_level_rewards * mask).sum(dim=-1)


def _broadcast(adv: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A sequence-level advantage on every valid token: A_it = a_i m_it."""
    return adv.to(dtype).unsqueeze(-1) * mask.to(dtype)


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024): A_it = (s_i - mean_g) / (std_g + epsilon) on every valid token,
    std unbiased over the group g of sample i; ``norm_adv_by_std_in_grpo=False`` gives
    s_i - mean_g. Returns equal advantages. A group of one gets 0."""
    gid, n_groups = _group_ids(index, token_level_rewards.shape[0], "grpo")
    scores = _outcome_scores(token_level_rewards, response_mask)
    count, mean, std = _group_stats(scores, gid, n_groups)
    adv = scores.double() - mean
    if norm_adv_by_std_in_grpo:
        adv = adv / (std + epsilon)
    adv = torch.where(count > 1, adv, 0.0)
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)
    return out, out


def compute_grpo_multiturn_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    *,
    turn_scores: torch.Tensor | None = None,
    global_scores: torch.Tensor | None = None,
    token_level_scores: torch.Tensor | None = None,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-turn GRPO (spec 001): the turn part and the global part of the structured reward
    are normalised separately within each group g, then added:

        A_it = z_g(T)_i + z_g(G')_i  on every valid token,
        z_g(x)_i = (x_i - mean_g x) / (std_g x + eps)

    with T_i = mean over turns of sample i's turn rewards (``turn_scores``, (B,)) and
    G'_i = G_i + e_i, where G_i is its counted global reward sum (``global_scores``, (B,)), as
    the structured reward manager writes them, and

        e_i = sum_t (r_it - s_it) m_it

    the per-token reward terms the trainer added on top of the task's scores s
    (``token_level_scores``) to make the rewards r (``token_level_rewards``): -beta kl_t when KL
    is in the reward, DAPO's overlong penalty. They are sequence-level sums, like the global
    part, so they join it (as GRPO sums them into its outcome score); e_i = 0 when r = s, and
    then this is spec 001's estimator exactly. std unbiased, no division when
    ``norm_adv_by_std_in_grpo`` is False. A part that does not vary in a group contributes 0; a
    group of one gets 0. Without the two parts (an unstructured reward), T = 0 and
    G'_i = sum_t r_it m_it, which is GRPO. Returns equal advantages."""
    if turn_scores is None or global_scores is None:
        turn_scores = torch.zeros(token_level_rewards.shape[0])
        global_scores = _outcome_scores(token_level_rewards, response_mask)
    elif token_level_scores is not None:
        extra = _outcome_scores(
            token_level_rewards.double() - token_level_scores.double(), response_mask
        )
        global_scores = global_scores.to(torch.float64).reshape(-1) + extra.cpu()
    gid, n_groups = _group_ids(index, token_level_rewards.shape[0], "grpo_multiturn")
    adv = torch.zeros(token_level_rewards.shape[0], dtype=torch.float64)
    for part in (turn_scores, global_scores):
        part = part.to(torch.float64).reshape(-1).cpu()
        count, mean, std = _group_stats(part, gid, n_groups)
        z = part - mean
        if norm_adv_by_std_in_grpo:
            z = z / (std + epsilon)
        adv += torch.where(count > 1, z, 0.0)
    out = _broadcast(adv.to(response_mask.device), response_mask, token_level_rewards.dtype)
    return out, out


def compute_dr_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO (Liu et al. 2025): A_it = s_i - mean_g, no division by the group std (pair it
    with ``loss_agg_mode=seq-mean-token-sum-norm``). A group of one gets 0."""
    options["norm_adv_by_std_in_grpo"] = False
    return compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, **options)


def compute_rloo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO (Ahmadian et al. 2024): leave-one-out baseline,
    A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1) = n_g / (n_g - 1) (s_i - mean_g).
    A group of one gets 0."""
    gid, n_groups = _group_ids(index, token_level_rewards.shape[0], "rloo")
    scores = _outcome_scores(token_level_rewards, response_mask)
    count, mean, _ = _group_stats(scores, gid, n_groups)
    adv = torch.where(count > 1, count / (count - 1).clamp(min=1) * (scores.double() - mean), 0.0)
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)
    return out, out


def compute_opo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO (Hao et al. 2025): length-weighted group baseline, A_i = s_i - sum_j L_j s_j / sum_j L_j
    over the group, L_j = number of valid tokens of sample j. A group of one gets 0."""
    gid, n_groups = _group_ids(index, token_level_rewards.shape[0], "opo")
    scores = _outcome_scores(token_level_rewards, response_mask)
    lengths = response_mask.to(torch.float64).sum(dim=-1)
    count, baseline, _ = _group_stats(scores, gid, n_groups, weights=lengths)
    adv = torch.where(count > 1, scores.double() - baseline, 0.0)
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)
    return out, out


def compute_gpg_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    *,
    f_norm: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (Chu et al. 2025): A_i = alpha (s_i - mean_g) / f_norm with alpha = B / M, M the
    number of samples in the batch with a non-zero score (at least 1), as verl computes it.
    A group of one gets 0."""
    gid, n_groups = _group_ids(index, token_level_rewards.shape[0], "gpg")
    scores = _outcome_scores(token_level_rewards, response_mask)
    count, mean, _ = _group_stats(scores, gid, n_groups)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    adv = torch.where(count > 1, alpha * (scores.double() - mean) / f_norm, 0.0)
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)
    return out, out


def compute_grpo_passk_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    *,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (Thrampoulidis et al. 2025): only the best sample of each group learns,
    A = (s_max - s_second) / (std_g + epsilon) (no division when ``norm_adv_by_std_in_grpo`` is
    False); every other sample gets 0. Ties go to the earliest sample. A group of one gets 0."""
    gid, n_groups = _group_ids(index, token_level_rewards.shape[0], "grpo_passk")
    scores = _outcome_scores(token_level_rewards, response_mask).double()
    _, _, std = _group_stats(scores, gid, n_groups)
    by_score = torch.sort(scores, descending=True, stable=True).indices
    order = by_score[torch.sort(gid[by_score], stable=True).indices]
    g_sorted, s_sorted = gid[order], scores[order]
    is_best = torch.ones_like(g_sorted, dtype=torch.bool)
    is_best[1:] = g_sorted[1:] != g_sorted[:-1]
    has_second = torch.zeros_like(is_best)
    has_second[:-1] = is_best[:-1] & (g_sorted[1:] == g_sorted[:-1])
    gap = torch.zeros_like(s_sorted)
    gap[:-1] = s_sorted[:-1] - s_sorted[1:]
    adv_sorted = torch.where(has_second, gap, 0.0)
    if norm_adv_by_std_in_grpo:
        adv_sorted = adv_sorted / (std[order] + epsilon)
    adv = torch.zeros_like(scores).index_copy(0, order, adv_sorted)
    out = _broadcast(adv, response_mask, token_level_rewards.dtype)
    return out, out


def compute_reinforce_plus_plus_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    *,
    gamma: float = 1.0,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): returns G_t = sum_{k>=t} gamma^(k-t) r_k over valid steps;
    advantages = masked_whiten(G) over the whole batch."""
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _suffix_sum_over_valid(token_level_rewards, mask, gamma)
    return masked_whiten(returns, mask) * mask, returns


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: a_i = s_i - mean_g (0 for a group of one), put on
    every valid token, then whitened over the whole batch. Returns equal advantages."""
    gid, n_groups = _group_ids(index, token_level_rewards.shape[0], "reinforce_plus_plus_baseline")
    scores = _outcome_scores(token_level_rewards, response_mask)
    count, mean, _ = _group_stats(scores, gid, n_groups)
    adv = torch.where(count > 1, scores.double() - mean, 0.0)
    mask = response_mask.to(token_level_rewards.dtype)
    out = masked_whiten(_broadcast(adv, mask, mask.dtype), mask) * mask
    return out, out


def compute_remax_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Index | None = None,
    *,
    reward_baselines: torch.Tensor | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): returns G_t = sum_{k>=t} r_k over valid steps; advantages
    A_t = G_t - b with b (B,) the reward of the greedy response to the same prompt."""
    if reward_baselines is None:
        raise ValueError("adv_estimator 'remax' needs `reward_baselines` (B,): greedy rewards")
    mask = response_mask.to(token_level_rewards.dtype)
    returns = _suffix_sum_over_valid(token_level_rewards, mask, 1.0)
    adv = returns - reward_baselines.to(mask.dtype).unsqueeze(-1) * mask
    return adv, returns
