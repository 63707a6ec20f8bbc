"""Clipped value-function loss for the PPO critic (verl's ``compute_value_loss``)."""

from __future__ import annotations

import torch

from creditrl.core.aggregation import agg_loss
from creditrl.core.masked import masked_mean

__all__ = ["compute_value_loss"]


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    **agg_kwargs: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped squared error of the critic, all tensors (B, T), column j = step t = j + 1.

    With V̂ = ``vpreds[i, j]`` (current critic), V = ``values[i, j]`` (critic at rollout time,
    V(s_{i,t})), R = ``returns[i, j]`` and c = ``cliprange_value``:

        V̂_clip = V + clamp(V̂ - V, -c, c)
        vf_loss = 0.5 * agg_loss(max((V̂ - R)^2, (V̂_clip - R)^2), response_mask, mode)
        vf_clipfrac = mean over valid tokens of [(V̂_clip - R)^2 > (V̂ - R)^2]

    ``agg_kwargs`` (global normalisers, ``loss_scale_factor``) are passed to ``agg_loss``.
    Returns (vf_loss, vf_clipfrac), the latter detached.
    """
    vpredclipped = values + torch.clamp(vpreds - values, -cliprange_value, cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.maximum(vf_losses1, vf_losses2)
    vf_loss = 0.5 * agg_loss(clipped_vf_losses, response_mask, loss_agg_mode, **agg_kwargs)
    vf_clipfrac = masked_mean((vf_losses2 > vf_losses1).to(vpreds.dtype), response_mask)
    return vf_loss, vf_clipfrac.detach()
