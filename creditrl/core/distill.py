"""On-policy distillation: a teacher's per-token log-probs on the student's own samples.

Index convention (docs/architecture.md): column j of a (B, T) response tensor is step t = j + 1;
``teacher_log_prob[:, j]`` = log π_T(y_{j+1} | s^T_{j+1}), where the teacher's state s^T_t is
the teacher's prompt followed by the student's response tokens y_1 .. y_{t-1} (the same ids,
never re-tokenized); ``student_log_prob[:, j]`` = log π_S(y_{j+1} | s_{j+1}).
"""

from __future__ import annotations

import torch

from creditrl.core.policy_losses import PolicyLossConfig, _finish, log_ratio

__all__ = ["compute_policy_loss_distill", "distill_term"]


def distill_term(
    teacher_log_prob: torch.Tensor, student_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """The per-token distillation term d_t (B, T), a reward for the transition made by y_t:

        d_t = (log π_T(y_t | s^T_t) - log π_S(y_t | s_t)) · m_t

    with y_t sampled from π_S and m = ``response_mask``, so tokens the policy did not write
    (agent observations, padding) carry none. -d_t is the one-sample (k1) estimate of the
    per-token reverse KL, KL(π_S(· | s_t) || π_T(· | s^T_t)) = E_{y ~ π_S}[log π_S(y) -
    log π_T(y)]: maximising the sum of d_t pulls the student toward the teacher on the states
    the student itself visits.
    """
    mask = response_mask.to(student_log_prob.dtype)
    return (teacher_log_prob - student_log_prob) * mask


def compute_policy_loss_distill(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    *,
    teacher_log_prob: torch.Tensor,
    **agg_kwargs: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pure on-policy distillation: minimise the per-token reverse KL to the teacher on the
    sampled tokens; the advantages (and so the task reward) are not read.

    With r = exp(clamp(log π_θ(y_t) - log π_old(y_t), -20, 20)) (y_t was sampled from π_old)
    and d_t = ``distill_term(teacher_log_prob, log π_θ)`` evaluated at the current θ:

        l_t = -sg[d_t] · r_t

    Its gradient is E_{π_old}[r (log π_θ - log π_T) ∇ log π_θ] = ∇_θ KL(π_θ || π_T) per state
    (the score-function gradient of the reverse KL; E[∇ log π_θ] = 0 drops the +1), and at
    r = 1 (the first pass on fresh samples) its value is log π_θ - log π_T, the k1 estimate of
    that KL. No clip (clip fractions 0); ``ppo_kl`` as for every loss.
    """
    d = distill_term(teacher_log_prob, log_prob, response_mask).detach()
    ratio = torch.exp(log_ratio(old_log_prob, log_prob))
    pg_losses = -d * ratio
    return _finish(
        pg_losses, old_log_prob, log_prob, response_mask, loss_agg_mode, rollout_is_weights,
        agg_kwargs,
    )  # fmt: skip
