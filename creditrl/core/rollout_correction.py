"""Rollout/training mismatch correction: importance weights, rejection and mismatch metrics.

The rollout engine (e.g. vLLM in bf16) samples y_t with log-probs ``rollout_log_prob`` that
differ slightly from those the trainer recomputes, ``old_log_prob``. Semantics follow verl's
``compute_rollout_importance_weights`` / ``compute_mismatch_metrics`` (mismatch_helper.py):

- the returned weights are the true ratios pi_train / pi_rollout at the chosen level, detached,
  0 on padding; truncate mode clamps them from above only (TIS), mask mode keeps them as they
  are and rejects outliers through the returned mask (IcePop-style rejection), veto rejects
  whole sequences through the mask;
- metric keys are verl's, prefixed ``mismatch/``.

Index convention (docs/architecture.md): column j of a (B, T) tensor is step t = j + 1; with
m_{i,t} = response_mask[i, j] and the per-token log ratio

    delta_{i,t} = old_log_prob[i, j] - rollout_log_prob[i, j]
                = log pi_train(y_{i,t} | s_{i,t}) - log pi_rollout(y_{i,t} | s_{i,t}).

Values at positions with m = 0 are never read (they may hold anything, even inf or nan).
Everything is computed in at least float32, under ``torch.no_grad``.
"""

from __future__ import annotations

import math

import torch

from creditrl.core.masked import masked_mean, masked_sum
from creditrl.core.registries import ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES

__all__ = [
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "SAFETY_BOUND",
    "compute_mismatch_metrics",
    "compute_rollout_corr_metrics",
    "compute_rollout_importance_weights",
]


# Log ratios are clamped to [-SAFETY_BOUND, SAFETY_BOUND] before exp, as in verl:
# weights stay within [exp(-20), exp(20)] ~ [2.1e-9, 4.9e8], finite in float32.
SAFETY_BOUND = 20.0


def _prepare(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate shapes; return (old, rollout, valid) detached, with 0 where the mask is 0."""
    if old_log_prob.dim() != 2:
        raise ValueError(f"log-probs must be (batch, T), got shape {tuple(old_log_prob.shape)}")
    if rollout_log_prob.shape != old_log_prob.shape or response_mask.shape != old_log_prob.shape:
        raise ValueError(
            "old_log_prob, rollout_log_prob and response_mask must share one shape, got "
            f"{tuple(old_log_prob.shape)}, {tuple(rollout_log_prob.shape)}, "
            f"{tuple(response_mask.shape)}"
        )
    valid = response_mask.detach().bool()
    if not bool(valid.any()):
        raise ValueError("response_mask has no valid token: nothing to compare")
    dtype = torch.promote_types(old_log_prob.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=old_log_prob.device)
    old = torch.where(valid, old_log_prob.detach().to(dtype), zero)
    rollout = torch.where(valid, rollout_log_prob.detach().to(dtype), zero)
    return old, rollout, valid


def _to_floats(stats: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors to Python floats with a single device→host transfer."""
    values = torch.stack([v.detach().to(torch.float64).reshape(()) for v in stats.values()])
    return dict(zip(stats.keys(), values.tolist(), strict=True))


def _mismatch_stats(
    old: torch.Tensor, rollout: torch.Tensor, valid: torch.Tensor
) -> dict[str, torch.Tensor]:
    m = valid.to(old.dtype)
    seq_valid = valid.any(dim=-1)
    mean_lp_train = masked_mean(old, m, dim=-1)[seq_valid]
    mean_lp_rollout = masked_mean(rollout, m, dim=-1)[seq_valid]
    log_ppl_diff = mean_lp_rollout - mean_lp_train
    delta = (old - rollout).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "mismatch_training_ppl": torch.exp(-mean_lp_train).mean(),
        "mismatch_training_log_ppl": (-mean_lp_train).mean(),
        "mismatch_kl": masked_mean(rollout - old, m),
        "mismatch_k3_kl": masked_mean(torch.expm1(delta) - delta, m),
        "mismatch_rollout_ppl": torch.exp(-mean_lp_rollout).mean(),
        "mismatch_rollout_log_ppl": (-mean_lp_rollout).mean(),
        "mismatch_log_ppl_diff": log_ppl_diff.mean(),
        "mismatch_log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "mismatch_log_ppl_diff_max": log_ppl_diff.max(),
        "mismatch_log_ppl_diff_min": log_ppl_diff.min(),
        "mismatch_ppl_ratio": torch.exp(log_ppl_diff).mean(),
    }


def compute_mismatch_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """Training/rollout mismatch diagnostics (monitoring only, no weights); verl's key names.

    With delta_{i,t} as in the module docstring, N = sum_{i,t} m_{i,t}, S the set of sequences
    with at least one valid token, L_i = sum_t m_{i,t}, and per-sequence mean log-probs
    lbar^train_i = sum_t m_{i,t} old_{i,t} / L_i,  lbar^roll_i likewise:

    - ``mismatch_kl`` (k1) = sum_{i,t} m_{i,t} (-delta_{i,t}) / N, estimates KL(pi_roll || pi_train)
    - ``mismatch_k3_kl`` (k3) = sum_{i,t} m_{i,t} (exp(d) - d - 1) / N, d = clamp(delta, ±20)
    - ``mismatch_training_ppl`` = mean_{i in S} exp(-lbar^train_i) (per-sequence perplexity,
      then averaged over sequences, as verl); ``mismatch_training_log_ppl`` = mean_S(-lbar^train_i)
    - ``mismatch_rollout_ppl``, ``mismatch_rollout_log_ppl``: the same with rollout log-probs
    - ``mismatch_log_ppl_diff`` = mean_S D_i with D_i = lbar^roll_i - lbar^train_i
      = log(ppl^train_i / ppl^roll_i); also ``_abs_diff`` (mean |D_i|), ``_diff_max``, ``_diff_min``
    - ``mismatch_ppl_ratio`` = mean_S exp(D_i) (per-sequence ppl ratio, then averaged)

    Sequence averages run over S (verl averages over all rows; the two agree when every row has
    a valid token). Keys are unprefixed, as verl's helper; ``compute_rollout_importance_weights``
    adds ``mismatch/``. Raises ValueError when no token is valid.
    """
    with torch.no_grad():
        old, rollout, valid = _prepare(old_log_prob, rollout_log_prob, response_mask)
        return _to_floats(_mismatch_stats(old, rollout, valid))


def compute_rollout_corr_metrics(
    train_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, float]:
    """How far the sampler's log-probs are from the trainer's, logged whether or not rollout IS
    is on (keys ``rollout_corr/*``; empty when no token is valid).

    ``train_log_prob`` is the training forward's log pi_train(y_t | s_t) on the same weights
    that sampled (``old_log_probs`` when recomputed, else the update's first mini-batch
    forward); with delta as in the module docstring (train - rollout) and the notation of
    ``compute_mismatch_metrics``:

    - ``rollout_corr/k1_kl``, ``rollout_corr/k3_kl``: that function's ``mismatch_kl`` and
      ``mismatch_k3_kl`` (estimates of KL(pi_rollout || pi_train));
    - ``rollout_corr/log_ppl_diff`` = mean_S (lbar^roll_i - lbar^train_i) and
      ``rollout_corr/log_ppl_abs_diff`` = mean_S |lbar^roll_i - lbar^train_i|;
    - ``rollout_corr/max_abs_logp_diff`` = max over valid (i, t) of |delta_{i,t}|;
    - ``rollout_corr/training_ppl``, ``rollout_corr/rollout_ppl``: per-sequence perplexities
      averaged over S.

    All 0 when sampler and trainer agree exactly.
    """
    if not bool(response_mask.bool().any()):
        return {}
    with torch.no_grad():
        old, rollout, valid = _prepare(train_log_prob, rollout_log_prob, response_mask)
        stats = _mismatch_stats(old, rollout, valid)
        picked = {
            "k1_kl": stats["mismatch_kl"],
            "k3_kl": stats["mismatch_k3_kl"],
            "log_ppl_diff": stats["mismatch_log_ppl_diff"],
            "log_ppl_abs_diff": stats["mismatch_log_ppl_abs_diff"],
            "max_abs_logp_diff": (old - rollout).abs().masked_fill(~valid, 0.0).max(),
            "training_ppl": stats["mismatch_training_ppl"],
            "rollout_ppl": stats["mismatch_rollout_ppl"],
        }
        return {f"rollout_corr/{k}": v for k, v in _to_floats(picked).items()}


def _weight_stats(
    raw: torch.Tensor,
    log_w: torch.Tensor,
    valid: torch.Tensor,
    level: str,
    lower: float,
    upper: float,
) -> dict[str, torch.Tensor]:
    """verl's ``compute_is_metrics`` on the untruncated ratios ``raw`` (B, T)."""
    m = valid.to(raw.dtype)
    seq_valid = valid.any(dim=-1)
    n = m.sum()
    stats: dict[str, torch.Tensor] = {"rollout_is_mean": masked_mean(raw, m)}
    if level == "token":
        stats["rollout_is_max"] = raw.masked_fill(~valid, -math.inf).max()
        stats["rollout_is_min"] = raw.masked_fill(~valid, math.inf).min()
        stats["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(m.dtype), m)
        stats["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).to(m.dtype), m)
    else:
        seq_log_w = log_w.squeeze(-1)[seq_valid]
        stats["rollout_is_max"] = torch.exp(seq_log_w.max().clamp(max=SAFETY_BOUND))
        stats["rollout_is_min"] = torch.exp(seq_log_w.min())
        stats["rollout_is_ratio_fraction_high"] = (seq_log_w > math.log(upper)).to(m.dtype).mean()
        stats["rollout_is_ratio_fraction_low"] = (seq_log_w < math.log(lower)).to(m.dtype).mean()
    w = raw.clamp(min=lower, max=upper)
    sum_w, sum_w2 = masked_sum(w, m), masked_sum(w * w, m)
    var = sum_w2 / n - (sum_w / n) ** 2
    stats["rollout_is_std"] = var.clamp(min=0.0).sqrt() if n > 1 else torch.zeros_like(n)
    stats["rollout_is_eff_sample_size"] = (sum_w * sum_w / (n * sum_w2)).clamp(max=1.0)
    seq_mean = masked_mean(raw, m, dim=-1)[seq_valid]
    stats["rollout_is_seq_mean"] = seq_mean.mean()
    stats["rollout_is_seq_std"] = seq_mean.std() if seq_mean.numel() > 1 else seq_mean.new_zeros(())
    stats["rollout_is_seq_max"] = seq_mean.max()
    stats["rollout_is_seq_min"] = seq_mean.min()
    stats["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max()
    stats["rollout_is_seq_fraction_high"] = (seq_mean > upper).to(m.dtype).mean()
    stats["rollout_is_seq_fraction_low"] = (seq_mean < lower).to(m.dtype).mean()
    return stats


def compute_rollout_importance_weights(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is_level: str = "token",
    rollout_is_mode: str = "truncate",
    rollout_is_threshold: float = 2.0,
    rollout_is_threshold_lower: float | None = None,
    rollout_is_veto_threshold: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Importance weights pi_train / pi_rollout, rejection mask and metrics (verl semantics).

    With delta_{i,t}, m_{i,t} as in the module docstring (column j = step t = j + 1),
    clip(x) = clamp(x, -20, 20), U = ``rollout_is_threshold``, L = ``rollout_is_threshold_lower``
    (default 1 / U):

    - ``token``:     rho_{i,t} = exp(clip(delta_{i,t}))
    - ``sequence``:  rho_{i,t} = exp(clip(sum_u m_{i,u} delta_{i,u}))   (same for every t of i)
    - ``geometric``: rho_{i,t} = exp(clip(sum_u m_{i,u} delta_{i,u} / sum_u m_{i,u}))

    Mode (outlier handling):

    - ``truncate`` (TIS): w_{i,t} = min(rho_{i,t}, U). Only the upper side is clamped, as in
      verl: small ratios are kept (they shrink a token's update, they cannot blow it up).
      The mask is unchanged by this step.
    - ``mask`` (rejection, IcePop-style): w_{i,t} = rho_{i,t} (true ratios, not zeroed, as in
      verl); keep_{i,t} = [L <= rho_{i,t} <= U], so the mask drops tokens (token level) or whole
      sequences (sequence / geometric level) outside [L, U].

    Veto (any mode, if ``rollout_is_veto_threshold`` V is set): sequence i is rejected
    (mask 0 on all of its tokens) if some valid t has delta_{i,t} < log V (unclamped).

    Returns ``(weights, loss_mask, metrics)``:
    ``weights`` (B, T) = w_{i,t} m_{i,t}, detached, dtype max(input, float32);
    ``loss_mask`` = response_mask * keep * (1 - vetoed_i), in response_mask's dtype: the tokens
    the policy loss may use. It is a separate mask for the losses only; it must never replace
    ``response_mask``, which defines the trajectory (scores, KL, advantages, returns);
    ``metrics``: floats under ``mismatch/``, verl's names:

    - ``rollout_is_mean`` (token mean of rho), ``_max``, ``_min`` (token level: over valid tokens;
      sequence / geometric: over sequences, from the unclamped log ratio, max capped at e^20),
      ``rollout_is_ratio_fraction_high`` / ``_low``: share of rho above U / below L (of valid
      tokens at token level, of sequences otherwise; log space there);
    - ``rollout_is_std`` (population std) and ``rollout_is_eff_sample_size``
      ESS = (sum m w~)^2 / (N sum m w~^2) in (0, 1], both on w~ = clamp(rho, L, U) over the
      valid tokens of the original mask, as verl (without its 1e-8);
    - ``rollout_is_seq_{mean,std,max,min,max_deviation,fraction_high,fraction_low}``: statistics
      of the per-sequence token mean of rho;
    - truncate mode: ``rollout_is_clipped_fraction`` (valid tokens with rho > U) and
      ``rollout_is_seq_clipped_fraction`` (sequences with such a token): our additions;
    - mask mode: ``rollout_is_masked_fraction`` (valid tokens outside [L, U]) and
      ``rollout_is_seq_masked_fraction`` (sequences with such a token);
    - ``rollout_is_veto_fraction`` (sequences vetoed), ``rollout_is_catastrophic_token_fraction``
      (valid tokens with ratio < V); both 0 when veto is off;
    - every key of ``compute_mismatch_metrics``.

    Sequence fractions count sequences with at least one valid token. Raises ValueError for an
    unknown level or mode, non-positive thresholds, L > U, or no valid token.
    """
    if rollout_is_level not in ROLLOUT_IS_LEVELS:
        raise ValueError(
            f"rollout_is_level must be one of {ROLLOUT_IS_LEVELS}, got {rollout_is_level!r}"
        )
    if rollout_is_mode not in ROLLOUT_IS_MODES:
        raise ValueError(
            f"rollout_is_mode must be one of {ROLLOUT_IS_MODES}, got {rollout_is_mode!r}"
        )
    upper = float(rollout_is_threshold)
    if not (0 < upper < math.inf):
        raise ValueError(f"rollout_is_threshold must be positive and finite, got {upper}")
    lower = 1.0 / upper if rollout_is_threshold_lower is None else float(rollout_is_threshold_lower)
    if not (0 < lower <= upper):
        raise ValueError(
            "need 0 < rollout_is_threshold_lower <= rollout_is_threshold < inf, "
            f"got lower={lower}, upper={upper}"
        )
    if rollout_is_veto_threshold is not None and not rollout_is_veto_threshold > 0:
        raise ValueError(f"rollout_is_veto_threshold must be > 0, got {rollout_is_veto_threshold}")

    with torch.no_grad():
        old, rollout, valid = _prepare(old_log_prob, rollout_log_prob, response_mask)
        m = valid.to(old.dtype)
        seq_valid = valid.any(dim=-1)
        delta = old - rollout
        if rollout_is_level == "token":
            log_w = delta
        elif rollout_is_level == "sequence":
            log_w = masked_sum(delta, m, dim=-1).unsqueeze(-1)
        else:
            log_w = masked_mean(delta, m, dim=-1).unsqueeze(-1)
        raw = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(delta)

        stats = _weight_stats(raw, log_w, valid, rollout_is_level, lower, upper)

        if rollout_is_mode == "truncate":
            clipped = (raw > upper) & valid
            stats["rollout_is_clipped_fraction"] = masked_mean(clipped.to(m.dtype), m)
            stats["rollout_is_seq_clipped_fraction"] = clipped.any(-1)[seq_valid].to(m.dtype).mean()
            weights = raw.clamp(max=upper)
            keep = valid
        else:
            keep = (raw >= lower) & (raw <= upper)
            rejected = ~keep & valid
            stats["rollout_is_masked_fraction"] = masked_mean(rejected.to(m.dtype), m)
            stats["rollout_is_seq_masked_fraction"] = rejected.any(-1)[seq_valid].to(m.dtype).mean()
            weights = raw

        if rollout_is_veto_threshold is not None:
            catastrophic = (delta < math.log(rollout_is_veto_threshold)) & valid
        else:
            catastrophic = torch.zeros_like(valid)
        vetoed = catastrophic.any(dim=-1, keepdim=True)
        stats["rollout_is_veto_fraction"] = vetoed.squeeze(-1)[seq_valid].to(m.dtype).mean()
        stats["rollout_is_catastrophic_token_fraction"] = masked_mean(catastrophic.to(m.dtype), m)

        keep = keep & valid & ~vetoed
        loss_mask = response_mask.detach() * keep.to(response_mask.dtype)
        weights = torch.where(valid, weights, torch.zeros_like(weights))

        stats.update(_mismatch_stats(old, rollout, valid))
        metrics = {f"mismatch/{k}": v for k, v in _to_floats(stats).items()}
    return weights, loss_mask, metrics
