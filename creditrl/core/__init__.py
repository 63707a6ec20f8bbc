"""Pure token-level functions on (batch, T) tensors: no models, no I/O.

Index convention (docs/architecture.md): column j of a response tensor is step t = j + 1;
``log_probs[:, j]`` = log pi(y_{j+1} | s_{j+1}) from ``logits[:, -T-1:-1]``; ``values[:, j]`` =
V(s_{j+1}). Each quantity has one defining function here, its math in the docstring.
"""

from creditrl.core.advantages import (
    ADV_ESTIMATORS,
    compute_advantage,
    compute_dr_grpo_outcome_advantage,
    compute_gae_advantage_return,
    compute_gpg_outcome_advantage,
    compute_grpo_outcome_advantage,
    compute_grpo_passk_outcome_advantage,
    compute_opo_outcome_advantage,
    compute_reinforce_plus_plus_baseline_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_remax_outcome_advantage,
    compute_rloo_outcome_advantage,
    get_advantage_estimator,
    register_adv_est,
)
from creditrl.core.aggregation import (
    LOSS_AGG_MODES,
    agg_loss,
    global_normalisers,
    register_loss_agg,
)
from creditrl.core.distill import compute_policy_loss_distill, distill_term
from creditrl.core.entropy import entropy_from_logits, log_probs_from_logits
from creditrl.core.kl import (
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    get_kl_controller,
    kl_penalty,
    register_kl_controller,
)
from creditrl.core.masked import masked_mean, masked_sum, masked_var, masked_whiten
from creditrl.core.policy_losses import (
    POLICY_LOSSES,
    PolicyLossConfig,
    compute_policy_loss_cispo,
    compute_policy_loss_gpg,
    compute_policy_loss_gspo,
    compute_policy_loss_ppo,
    compute_policy_loss_sapo,
    get_policy_loss,
    log_ratio,
    register_policy_loss,
)
from creditrl.core.rewards import (
    REWARD_DISTRIBUTIONS,
    apply_kl_penalty,
    last_valid_index,
    place_sequence_scores,
    structured_to_token_level,
    total_score,
)
from creditrl.core.rollout_correction import (
    ROLLOUT_IS_LEVELS,
    ROLLOUT_IS_MODES,
    compute_mismatch_metrics,
    compute_rollout_corr_metrics,
    compute_rollout_importance_weights,
)
from creditrl.core.value_loss import compute_value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "REWARD_DISTRIBUTIONS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "AdaptiveKLController",
    "FixedKLController",
    "PolicyLossConfig",
    "agg_loss",
    "apply_kl_penalty",
    "compute_advantage",
    "compute_dr_grpo_outcome_advantage",
    "compute_gae_advantage_return",
    "compute_gpg_outcome_advantage",
    "compute_grpo_outcome_advantage",
    "compute_grpo_passk_outcome_advantage",
    "compute_mismatch_metrics",
    "compute_opo_outcome_advantage",
    "compute_policy_loss_cispo",
    "compute_policy_loss_distill",
    "compute_policy_loss_gpg",
    "compute_policy_loss_gspo",
    "compute_policy_loss_ppo",
    "compute_policy_loss_sapo",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    "compute_reinforce_plus_plus_outcome_advantage",
    "compute_remax_outcome_advantage",
    "compute_rloo_outcome_advantage",
    "compute_rollout_corr_metrics",
    "compute_rollout_importance_weights",
    "compute_value_loss",
    "distill_term",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "global_normalisers",
    "kl_penalty",
    "last_valid_index",
    "log_probs_from_logits",
    "log_ratio",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "place_sequence_scores",
    "register_adv_est",
    "register_kl_controller",
    "register_loss_agg",
    "register_policy_loss",
    "structured_to_token_level",
    "total_score",
]
