"""Tinker's built-in losses, each built from creditrl's core losses and summed over tokens.

Tinker's losses are sums over every position of every datum (no mean), with the per-token
log-probs log π_θ(target_t | tokens_≤t) of the training forward; q_t below is the sampler's
log-prob (the datum's ``logprobs``), A_t its ``advantages``. Each uses
``creditrl.core.policy_losses`` with ``loss_agg_mode="token-sum"``:

- ``cross_entropy`` (``target_tokens``, ``weights``): l_t = -w_t log π_θ, the ``gpg`` loss with
  A_t = w_t;
- ``importance_sampling``: l_t = -r_t A_t, r_t = exp(log π_θ - q_t): the ``ppo`` loss with its
  trust region and dual clip opened (ε = c = 1e30, so no clip is ever active);
- ``ppo``: the ``ppo`` loss with ε_low = 1 - ``clip_low_threshold`` and ε_high =
  ``clip_high_threshold`` - 1 (defaults 0.8 and 1.2: ε = 0.2), dual clip off;
- ``cispo``: the ``cispo`` loss, -sg[clip(r_t, low, high)] A_t log π_θ, same thresholds;
- ``gspo`` (GSPO-token): the ``gspo`` loss, same thresholds, its sequence ratio s = exp(mean of
  (sg[log π_θ] - q) over the positions ``sequence_ratio_mask`` marks (absent: those trained on));
  each token carries s's value with its own gradient, l_t = -min(s_t A_t, clip(s_t) A_t);
- ``dro``: l_t = -A_t log π_θ + (β/2) (log π_θ - q_t)², over every position (the quadratic term
  counts where A_t = 0 too): ``gpg`` plus β times the ``k2`` KL estimate
  (``creditrl.core.kl``); ``beta`` defaults to 0.05;
- ``stable_reinforce``: the datums name the sequences they came from (provenance), sampled with
  ``record_stability_info``; q_t is then the log-prob the service recorded at sampling time
  (``creditrl.tinker.stability``), not the client's. Tinker documents the protocol; its
  objective's formula was not available here, so creditrl serves its own REINFORCE variant
  robust to a sampler that differs from the trainer: l_t = -w_t A_t log π_θ with the truncated
  importance weight w_t = sg[min(exp(log π_θ - q_t), 2)] (``gpg`` weighted by
  ``creditrl.core.rollout_correction``'s token-level truncate weights, threshold 2). Only
  sampled tokens may carry an advantage; ``kl_coeff`` is accepted only at 0.

Positions with advantage (or weight) 0 add nothing (except to ``dro``'s quadratic term), so the
mask passed is the positions trained on: the metrics ``pg_clipfrac:mean`` and ``ppo_kl:mean``
(ratio losses) average over them, and ``tokens:sum`` counts them; ``loss:sum`` is the summed
loss. Tinker's server-side ``custom`` losses are refused (``forward_backward_custom`` runs
client-side over ``cross_entropy``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from creditrl.core.kl import kl_penalty
from creditrl.core.policy_losses import PolicyLossConfig, get_policy_loss
from creditrl.core.rollout_correction import compute_rollout_importance_weights
from creditrl.tinker.messages import BadRequest, Datum

__all__ = ["LOSSES", "LossSpec", "check_loss", "loss_inputs", "tinker_loss"]

OPEN = 1e30  # a clip bound no ratio reaches
STABLE_TRUNCATION = 2.0  # stable_reinforce's importance-weight cap (creditrl's, see above)
FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")


@dataclass(frozen=True)
class LossSpec:
    """A Tinker loss: the ``loss_fn_inputs`` it needs, its config keys with their defaults,
    and whether its datums must carry provenance (checked against the stability records)."""

    inputs: tuple[str, ...]
    config: Mapping[str, float] = field(default_factory=dict)
    provenance: bool = False


RL = ("target_tokens", "logprobs", "advantages")
CLIPS = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens",)),
    "importance_sampling": LossSpec(RL),
    "ppo": LossSpec(RL, CLIPS),
    "cispo": LossSpec(RL, CLIPS),
    "gspo": LossSpec(RL, CLIPS),
    "dro": LossSpec(RL, {"beta": 0.05}),
    "stable_reinforce": LossSpec(("target_tokens", "advantages"), {"kl_coeff": 0.0}, True),
}


def check_loss(name: str, config: Mapping[str, float | str]) -> LossSpec:
    """The spec of Tinker loss ``name``; BadRequest for another loss, an unknown config key,
    or a value out of its range."""
    spec = LOSSES.get(name)
    if spec is None:
        if name == "custom":
            raise BadRequest(
                "server-side custom losses are not supported by this local service; "
                "forward_backward_custom runs the loss client-side against it"
            )
        raise BadRequest(
            f"loss_fn {name!r} is not supported by this local service; supported: "
            f"{', '.join(LOSSES)}"
        )
    unknown = sorted(set(config) - set(spec.config))
    if unknown:
        raise BadRequest(f"loss_fn {name!r} takes no config key {unknown[0]!r}")
    values = _values(spec, config)
    if "clip_low_threshold" in values and not (
        0.0 <= values["clip_low_threshold"] <= 1.0 <= values["clip_high_threshold"]
    ):
        raise BadRequest(
            f"{name} needs clip_low_threshold <= 1 <= clip_high_threshold, got "
            f"{values['clip_low_threshold']}, {values['clip_high_threshold']}"
        )
    if "beta" in values and not 0.0 <= values["beta"] < math.inf:
        raise BadRequest(f"dro needs a finite beta >= 0, got {values['beta']}")
    if values.get("kl_coeff", 0.0) != 0.0:
        raise BadRequest(
            "stable_reinforce's kl_coeff term is not served by this local service; leave "
            "kl_coeff at 0"
        )
    return spec


def _values(spec: LossSpec, config: Mapping[str, float | str]) -> dict[str, float]:
    values = dict(spec.config)
    for key, value in config.items():
        if isinstance(value, bool) or not isinstance(value, float | int):
            raise BadRequest(f"loss_fn_config[{key!r}] must be a number")
        if not math.isfinite(value):
            raise BadRequest(f"loss_fn_config[{key!r}] must be finite")
        values[key] = float(value)
    return values


def loss_inputs(datums: Sequence[Datum], width: int) -> dict[str, torch.Tensor]:
    """The float loss inputs every datum of ``datums`` has (``weights``, ``logprobs``,
    ``advantages``, ``sequence_ratio_mask``, and ``recorded``: the recorded sampler log-probs),
    each padded with zeros to (len(datums), width)."""
    out: dict[str, torch.Tensor] = {}
    for name in (*FLOAT_INPUTS, "recorded"):
        values = [d.recorded if name == "recorded" else d.inputs.get(name) for d in datums]
        if any(v is None for v in values):
            continue
        padded = torch.zeros((len(datums), width), dtype=torch.float32)
        for i, value in enumerate(values):
            padded[i, : len(value)] = value.float()
        out[name] = padded
    return out


def tinker_loss(
    name: str,
    config: Mapping[str, float | str],
    log_prob: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float], float]:
    """Loss ``name`` over a padded batch: ``log_prob`` (B, T) of the targets, ``inputs`` the
    loss inputs padded to (B, T) (``loss_inputs``), ``mask`` (B, T) 1 on real positions.
    Returns the summed loss (with its gradient), the Tinker metrics, and the number of
    positions trained on (what ``:mean`` metrics average over)."""
    spec = check_loss(name, config)
    values = _values(spec, config)
    dtype = log_prob.dtype
    if name == "cross_entropy":
        weights = inputs.get("weights", mask).to(dtype)
        trained = mask * (weights != 0)
        loss, _ = get_policy_loss("gpg")(log_prob.detach(), log_prob, weights, trained, "token-sum")
        return loss, {"loss:sum": float(loss.detach())}, float(trained.sum())
    advantages = inputs["advantages"].to(dtype)
    trained = mask * (advantages != 0)
    sampler = inputs["recorded" if spec.provenance else "logprobs"].to(dtype)
    if name == "dro":
        loss, metrics = get_policy_loss("gpg")(sampler, log_prob, advantages, mask, "token-sum")
        loss = loss + values["beta"] * (kl_penalty(log_prob, sampler, "k2") * mask).sum()
        trained = mask
    elif name == "stable_reinforce":
        loss, metrics = _stable_reinforce(sampler, log_prob, advantages, trained)
    else:
        cfg = _clip_config(name, values)
        extra = {}
        if name == "gspo":
            extra["ratio_mask"] = inputs.get("sequence_ratio_mask", trained) * mask
        loss, metrics = get_policy_loss("ppo" if name == "importance_sampling" else name)(
            sampler, log_prob, advantages, trained, "token-sum", cfg, **extra
        )
    tokens = float(trained.sum())
    out = {
        "loss:sum": float(loss.detach()),
        "pg_clipfrac:mean": float(metrics["pg_clipfrac"]),
        "ppo_kl:mean": float(metrics["ppo_kl"]),
        "tokens:sum": max(tokens, 1.0),
    }
    return loss, out, tokens


def _clip_config(name: str, values: Mapping[str, float]) -> PolicyLossConfig:
    if name == "importance_sampling":
        return PolicyLossConfig(clip_ratio=OPEN, clip_ratio_c=OPEN)
    return PolicyLossConfig(
        clip_ratio_low=1.0 - values["clip_low_threshold"],
        clip_ratio_high=values["clip_high_threshold"] - 1.0,
        clip_ratio_c=OPEN,
    )


def _stable_reinforce(
    recorded: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor, trained: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-sg[min(π_θ / q, 2)] A log π_θ summed over the trained positions (creditrl's objective
    for ``stable_reinforce``: see the module docstring), with the share of truncated weights
    as ``pg_clipfrac``."""
    if bool(trained.any()):
        weights, _, stats = compute_rollout_importance_weights(
            log_prob.detach(), recorded, trained, "token", "truncate", STABLE_TRUNCATION
        )
        clipped = stats["mismatch/rollout_is_clipped_fraction"]
    else:
        weights, clipped = torch.zeros_like(log_prob), 0.0
    loss, metrics = get_policy_loss("gpg")(
        recorded, log_prob, advantages, trained, "token-sum", rollout_is_weights=weights
    )
    metrics["pg_clipfrac"] = torch.as_tensor(clipped)
    return loss, metrics
