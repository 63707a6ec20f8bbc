"""Policy-gradient losses (a registry, selectable by name), following verl's ``core_algos``.

Every loss has one signature::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
       config=None, rollout_is_weights=None, **agg_kwargs) -> (pg_loss, metrics)

All tensors are (B, T); column j is step t = j + 1 of response i, so ``log_prob[i, j]`` =
log π_θ(y_{i,t} | s_{i,t}) and ``old_log_prob[i, j]`` = log π_old(y_{i,t} | s_{i,t}). Each
function builds a per-token loss l_{i,t}, multiplies it by the detached ``rollout_is_weights``
w_{i,t} when given, and reduces it with ``agg_loss(l * w, response_mask, loss_agg_mode,
**agg_kwargs)``; ``agg_kwargs`` (``global_num_tokens``, ``global_num_seqs``,
``loss_scale_factor``) let summed micro-batch losses give exactly the full-batch gradient.

``metrics`` holds detached scalars: ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``,
``ppo_kl`` = masked mean of (old_log_prob - log_prob). Losses without a clip report 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from creditrl.core.aggregation import agg_loss
from creditrl.core.masked import masked_mean
from creditrl.core.registries import (
    POLICY_LOSSES,
    get_policy_loss,
    register_policy_loss,
)

__all__ = [
    "POLICY_LOSSES",
    "PolicyLossConfig",
    "PolicyLossFn",
    "compute_policy_loss_cispo",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_ppo",
    "compute_policy_loss_sapo",
    "get_policy_loss",
    "log_ratio",
    "register_policy_loss",
]

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass
class PolicyLossConfig:
    """Knobs of the policy losses, with verl's names (``actor_rollout_ref.actor.*``) and defaults.

    - ``clip_ratio`` ε: default for both sides of the trust region [1 - ε_low, 1 + ε_high];
      ``clip_ratio_low`` / ``clip_ratio_high`` override one side (None → ``clip_ratio``).
      ppo, gspo and cispo (whose IS-weight bounds are these same two numbers in verl) use them.
    - ``clip_ratio_c``: dual-clip constant c > 1 of ppo (arXiv:1912.09729).
    - ``tau_pos`` / ``tau_neg``: sapo gate temperatures for A > 0 / A <= 0 (arXiv:2511.20347).
    - ``kwargs``: the options the selected loss declares as ``Option``s
      (``actor.policy_loss_kwargs``, declared defaults filled in).
    """

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def low(self) -> float:
        """ε_low: ``clip_ratio_low``, else ``clip_ratio``."""
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        """ε_high: ``clip_ratio_high``, else ``clip_ratio``."""
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


def log_ratio(old_log_prob: torch.Tensor, log_prob: torch.Tensor) -> torch.Tensor:
    """log r_{i,t} = clamp(log π_θ - log π_old, -20, 20) (the clamp keeps exp finite)."""
    return torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)


def _finish(
    pg_losses: torch.Tensor,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    rollout_is_weights: torch.Tensor | None,
    agg_kwargs: dict[str, float | None],
    pg_clipfrac: torch.Tensor | None = None,
    pg_clipfrac_lower: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weight by sg(w), aggregate, and collect the detached metrics."""
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights.detach()
    pg_loss = agg_loss(pg_losses, response_mask, loss_agg_mode, **agg_kwargs)
    zero = torch.zeros((), dtype=pg_loss.dtype, device=pg_loss.device)
    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": zero if pg_clipfrac is None else pg_clipfrac.detach(),
        "pg_clipfrac_lower": zero if pg_clipfrac_lower is None else pg_clipfrac_lower.detach(),
        "ppo_kl": masked_mean((old_log_prob - log_prob).detach(), response_mask),
    }
    return pg_loss, metrics


def compute_policy_loss_ppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate with dual clip (verl's ``compute_policy_loss_vanilla``).

    For token (i, t), stored at column j = t - 1, with r = exp(clamp(log π_θ - log π_old,
    -20, 20)) and A = A_{i,t}:

        l1 = -A r,   l2 = -A clip(r, 1 - ε_low, 1 + ε_high),   l = max(l1, l2)
        if A < 0:  l = min(l, -A c)          (dual clip, c = ``clip_ratio_c`` > 1)

    ``pg_clipfrac`` = mean over valid tokens of [l2 > l1]; ``pg_clipfrac_lower`` = mean of
    [A < 0 and max(l1, l2) > -A c]. A token on a flat branch gets zero gradient.
    """
    cfg = config or PolicyLossConfig()
    if cfg.clip_ratio_c <= 1.0:
        raise ValueError(f"dual-clip PPO needs clip_ratio_c > 1, got {cfg.clip_ratio_c}")
    ratio = torch.exp(log_ratio(old_log_prob, log_prob))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cfg.low, 1.0 + cfg.high)
    clipped = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * cfg.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clipped, pg_losses3), clipped)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(ratio.dtype), response_mask)
    pg_clipfrac_lower = masked_mean(
        ((clipped > pg_losses3) & negative).to(ratio.dtype), response_mask
    )
    return _finish(
        pg_losses,
        old_log_prob,
        log_prob,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        pg_clipfrac,
        pg_clipfrac_lower,
    )


def compute_policy_loss_gspo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    ratio_mask: torch.Tensor | None = None,
    **agg_kwargs: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (arXiv:2507.18071; verl's ``compute_policy_loss_gspo``).

    Sequence log-ratio over the steps m of response i that ``ratio_mask`` marks (non-zero;
    default ``response_mask``), |y_i| = sum_t m_{i,t}:

        log s_i = (1 / max(|y_i|, 1)) sum_t m_{i,t} (log π_θ(y_{i,t}) - log π_old(y_{i,t}))

    Token ratio in stop-gradient form (value s_i, gradient through token t alone):

        s_{i,t} = exp(min(log π_θ(y_{i,t}) - sg[log π_θ(y_{i,t})] + sg[log s_i], 10))
        l = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - ε_low, 1 + ε_high))

    The loss is aggregated over ``response_mask``, which may differ from ``ratio_mask`` (Tinker's
    ``sequence_ratio_mask``). No dual clip (``pg_clipfrac_lower`` = 0). verl always aggregates
    GSPO with ``seq-mean-token-mean`` (the paper's choice); here the caller's mode is used.
    """
    cfg = config or PolicyLossConfig()
    in_ratio = response_mask if ratio_mask is None else ratio_mask != 0
    mask = in_ratio.to(log_prob.dtype)
    lengths = mask.sum(-1).clamp(min=1.0)
    seq_log_ratio = ((log_prob - old_log_prob) * mask).sum(-1) / lengths
    token_log_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cfg.low, 1.0 + cfg.high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean((pg_losses2 > pg_losses1).to(ratio.dtype), response_mask)
    return _finish(
        pg_losses,
        old_log_prob,
        log_prob,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        pg_clipfrac,
    )


def compute_policy_loss_cispo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585; verl's ``compute_policy_loss_cispo``).

    Clip the importance weight, not the surrogate, and stop its gradient:

        r = exp(clamp(log π_θ(y_{i,t}) - log π_old(y_{i,t}), -20, 20))
        l = -sg[clip(r, 1 - ε_low, 1 + ε_high)] A_{i,t} log π_θ(y_{i,t})

    so every token keeps the gradient -sg[clip(r)] A ∇log π_θ. Bounds are verl's
    ``clip_ratio_low`` / ``clip_ratio_high``. ``pg_clipfrac`` = mean of [clip(r) != r].
    """
    cfg = config or PolicyLossConfig()
    ratio = torch.exp(log_ratio(old_log_prob, log_prob))
    clipped_ratio = torch.clamp(ratio, 1.0 - cfg.low, 1.0 + cfg.high).detach()
    pg_losses = -clipped_ratio * advantages * log_prob
    pg_clipfrac = masked_mean((ratio != clipped_ratio).to(ratio.dtype), response_mask)
    return _finish(
        pg_losses,
        old_log_prob,
        log_prob,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
        pg_clipfrac,
    )


def compute_policy_loss_gpg(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG / plain REINFORCE (arXiv:2504.02546): l = -A_{i,t} log π_θ(y_{i,t}), no ratio."""
    pg_losses = -log_prob * advantages
    return _finish(
        pg_losses,
        old_log_prob,
        log_prob,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
    )


def compute_policy_loss_sapo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
    **agg_kwargs: float | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO soft gate (Qwen, arXiv:2511.20347; verl's ``compute_policy_loss_sapo``).

    With r = exp(clamp(log π_θ(y_{i,t}) - log π_old(y_{i,t}), -20, 20)),
    τ = ``tau_pos`` if A_{i,t} > 0 else ``tau_neg``, and σ the logistic function:

        f(r) = (4 / τ) σ(τ (r - 1)),     l = -f(r) A_{i,t}

    f'(r) = 4 σ(1 - σ), which is 1 at r = 1, so the gradient there is -A ∇log π_θ and it decays
    smoothly as r leaves 1 (a soft trust region, no hard clip; clip fractions are 0). verl
    always aggregates SAPO with ``seq-mean-token-mean``; here the caller's mode is used.
    """
    cfg = config or PolicyLossConfig()
    if cfg.tau_pos <= 0 or cfg.tau_neg <= 0:
        raise ValueError(f"sapo needs tau_pos, tau_neg > 0, got {cfg.tau_pos}, {cfg.tau_neg}")
    ratio = torch.exp(log_ratio(old_log_prob, log_prob))
    taus = torch.where(
        advantages > 0,
        torch.as_tensor(cfg.tau_pos, dtype=ratio.dtype, device=ratio.device),
        torch.as_tensor(cfg.tau_neg, dtype=ratio.dtype, device=ratio.device),
    )
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    return _finish(
        pg_losses,
        old_log_prob,
        log_prob,
        response_mask,
        loss_agg_mode,
        rollout_is_weights,
        agg_kwargs,
    )
