"""Pure token-level functions on (batch, T) tensors: no models, no I/O.

Index convention (docs/architecture.md): column j of a response tensor is step t = j + 1;
``log_probs[:, j]`` = log pi(y_{j+1} | s_{j+1}) from ``logits[:, -T-1:-1]``; ``values[:, j]`` =
V(s_{j+1}). Each quantity has one defining function here, its math in the docstring.

Names are imported on first use (``from creditrl.core import masked_mean`` loads
``creditrl.core.masked`` then), so the registries in ``creditrl.core.registries`` are read
without importing torch.
"""

from __future__ import annotations

from creditrl.lazy import names_on_first_use

_HOMES = {
    "ADV_ESTIMATORS": "creditrl.core.registries",
    "AdaptiveKLController": "creditrl.core.kl",
    "FixedKLController": "creditrl.core.kl",
    "KL_CONTROLLERS": "creditrl.core.registries",
    "KL_ESTIMATORS": "creditrl.core.registries",
    "LOSS_AGG_MODES": "creditrl.core.registries",
    "POLICY_LOSSES": "creditrl.core.registries",
    "PolicyLossConfig": "creditrl.core.policy_losses",
    "REWARD_DISTRIBUTIONS": "creditrl.core.registries",
    "ROLLOUT_IS_LEVELS": "creditrl.core.registries",
    "ROLLOUT_IS_MODES": "creditrl.core.registries",
    "agg_loss": "creditrl.core.aggregation",
    "apply_kl_penalty": "creditrl.core.rewards",
    "compute_advantage": "creditrl.core.advantages",
    "compute_dr_grpo_outcome_advantage": "creditrl.core.advantages",
    "compute_gae_advantage_return": "creditrl.core.advantages",
    "compute_gpg_outcome_advantage": "creditrl.core.advantages",
    "compute_grpo_outcome_advantage": "creditrl.core.advantages",
    "compute_grpo_passk_outcome_advantage": "creditrl.core.advantages",
    "compute_mismatch_metrics": "creditrl.core.rollout_correction",
    "compute_opo_outcome_advantage": "creditrl.core.advantages",
    "compute_policy_loss_cispo": "creditrl.core.policy_losses",
    "compute_policy_loss_distill": "creditrl.core.distill",
    "compute_policy_loss_gpg": "creditrl.core.policy_losses",
    "compute_policy_loss_gspo": "creditrl.core.policy_losses",
    "compute_policy_loss_ppo": "creditrl.core.policy_losses",
    "compute_policy_loss_sapo": "creditrl.core.policy_losses",
    "compute_reinforce_plus_plus_baseline_outcome_advantage": "creditrl.core.advantages",
    "compute_reinforce_plus_plus_outcome_advantage": "creditrl.core.advantages",
    "compute_remax_outcome_advantage": "creditrl.core.advantages",
    "compute_rloo_outcome_advantage": "creditrl.core.advantages",
    "compute_rollout_corr_metrics": "creditrl.core.rollout_correction",
    "compute_rollout_importance_weights": "creditrl.core.rollout_correction",
    "compute_value_loss": "creditrl.core.value_loss",
    "distill_term": "creditrl.core.distill",
    "entropy_from_logits": "creditrl.core.entropy",
    "get_advantage_estimator": "creditrl.core.registries",
    "get_kl_controller": "creditrl.core.kl",
    "get_policy_loss": "creditrl.core.registries",
    "global_normalisers": "creditrl.core.aggregation",
    "kl_penalty": "creditrl.core.kl",
    "last_valid_index": "creditrl.core.rewards",
    "log_probs_from_logits": "creditrl.core.entropy",
    "log_ratio": "creditrl.core.policy_losses",
    "masked_mean": "creditrl.core.masked",
    "masked_sum": "creditrl.core.masked",
    "masked_var": "creditrl.core.masked",
    "masked_whiten": "creditrl.core.masked",
    "place_sequence_scores": "creditrl.core.rewards",
    "register_adv_est": "creditrl.core.registries",
    "register_kl_controller": "creditrl.core.registries",
    "register_loss_agg": "creditrl.core.registries",
    "register_policy_loss": "creditrl.core.registries",
    "structured_to_token_level": "creditrl.core.rewards",
    "total_score": "creditrl.core.rewards",
}

__all__ = sorted(_HOMES)


__getattr__ = names_on_first_use(__name__, _HOMES)
