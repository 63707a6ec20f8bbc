"""Tinker's built-in losses, each one of creditrl's policy losses summed over tokens.

Tinker's losses are sums over every position of every datum (no mean), with the per-token
log-probs log π_θ(target_t | tokens_≤t) of the training forward. Each maps onto a registered
policy loss of ``creditrl.core.policy_losses`` with ``loss_agg_mode="token-sum"``:

- ``cross_entropy`` (inputs ``target_tokens``, ``weights``): l_t = -w_t log π_θ, which is the
  ``gpg`` loss -A_t log π_θ with A_t = w_t;
- ``importance_sampling`` (``target_tokens``, ``logprobs``, ``advantages``):
  l_t = -r_t A_t, r_t = exp(log π_θ - log q) with q the sampler's log-probs: the ``ppo`` loss
  with its trust region and dual clip opened (ε = c = 1e30, so no clip is ever active);
- ``ppo``: the ``ppo`` loss with ε_low = 1 - ``clip_low_threshold`` and ε_high =
  ``clip_high_threshold`` - 1 (defaults 0.8 and 1.2: ε = 0.2), dual clip off;
- ``cispo``: the ``cispo`` loss, -sg[clip(r_t, low, high)] A_t log π_θ, same thresholds.

Positions with advantage (or weight) 0 add nothing to these sums, so the mask passed is the
positions trained on: the metrics ``pg_clipfrac:mean`` and ``ppo_kl:mean`` (ratio losses)
average over them, and ``tokens:sum`` counts them; ``loss:sum`` is the summed loss. Other
Tinker losses (``dro``, ``gspo``, ``stable_reinforce``, ``custom``) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from creditrl.core.policy_losses import PolicyLossConfig, get_policy_loss
from creditrl.tinker.messages import BadRequest

__all__ = ["LOSSES", "LossSpec", "check_loss", "tinker_loss"]

OPEN = 1e30  # a clip bound no ratio reaches


@dataclass(frozen=True)
class LossSpec:
    """A Tinker loss: the creditrl policy loss it runs, the inputs it needs, the config keys
    it takes."""

    policy_loss: str
    inputs: tuple[str, ...]
    config_keys: tuple[str, ...] = ()


CLIPS = ("clip_low_threshold", "clip_high_threshold")
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec("gpg", ("target_tokens",)),
    "importance_sampling": LossSpec("ppo", ("target_tokens", "logprobs", "advantages")),
    "ppo": LossSpec("ppo", ("target_tokens", "logprobs", "advantages"), CLIPS),
    "cispo": LossSpec("cispo", ("target_tokens", "logprobs", "advantages"), CLIPS),
}


def check_loss(name: str, config: Mapping[str, float | str]) -> LossSpec:
    """The spec of Tinker loss ``name``; BadRequest for another loss or an unknown key."""
    spec = LOSSES.get(name)
    if spec is None:
        raise BadRequest(
            f"loss_fn {name!r} is not supported by this local service; supported: "
            f"{', '.join(LOSSES)}"
        )
    unknown = sorted(set(config) - set(spec.config_keys))
    if unknown:
        raise BadRequest(f"loss_fn {name!r} takes no config key {unknown[0]!r}")
    for key in spec.config_keys:
        if key in config and not isinstance(config[key], float | int):
            raise BadRequest(f"loss_fn_config[{key!r}] must be a number")
    return spec


def _config(name: str, config: Mapping[str, float | str]) -> PolicyLossConfig:
    if name == "importance_sampling" or name == "cross_entropy":
        return PolicyLossConfig(clip_ratio=OPEN, clip_ratio_c=OPEN)
    low = float(config.get("clip_low_threshold", 0.8))
    high = float(config.get("clip_high_threshold", 1.2))
    if not 0.0 <= low <= 1.0 <= high:
        raise BadRequest(
            f"{name} needs clip_low_threshold <= 1 <= clip_high_threshold, got {low}, {high}"
        )
    return PolicyLossConfig(clip_ratio_low=1.0 - low, clip_ratio_high=high - 1.0, clip_ratio_c=OPEN)


def tinker_loss(
    name: str,
    config: Mapping[str, float | str],
    log_prob: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Loss ``name`` over a padded batch: ``log_prob`` (B, T) of the targets, ``inputs`` the
    loss inputs padded to (B, T), ``mask`` (B, T) 1 on real positions. Returns the summed loss
    (with its gradient) and the Tinker metrics."""
    spec = check_loss(name, config)
    loss_fn = get_policy_loss(spec.policy_loss)
    if name == "cross_entropy":
        weights = inputs.get("weights", mask.to(log_prob.dtype))
        old, advantages = log_prob.detach(), weights.to(log_prob.dtype)
    else:
        old, advantages = inputs["logprobs"].to(log_prob.dtype), inputs["advantages"]
    loss, metrics = loss_fn(
        old,
        log_prob,
        advantages.to(log_prob.dtype),
        mask,
        "token-sum",
        _config(name, config),
    )
    out = {"loss:sum": float(loss.detach())}
    if name != "cross_entropy":
        tokens = max(float(mask.sum()), 1.0)
        out["pg_clipfrac:mean"] = float(metrics["pg_clipfrac"])
        out["ppo_kl:mean"] = float(metrics["ppo_kl"])
        out["tokens:sum"] = tokens
    return loss, out
