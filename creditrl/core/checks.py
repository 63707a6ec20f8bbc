"""The config checks that need what ``creditrl.core``'s registries declared (an estimator's
``requires``, ``grouped`` and ``options``; a loss's, aggregation's or KL controller's
``options``; a loss's ``requires``), registered with ``creditrl.config.checks``: the registry
knows its entries, ``creditrl.config`` only names the settings."""

from __future__ import annotations

from typing import Any

import creditrl.core
from creditrl.config.checks import register_config_check, register_unused_rule
from creditrl.config.schema import Config
from creditrl.config.validate import check_batches
from creditrl.core import ADV_ESTIMATORS, POLICY_LOSSES
from creditrl.errors import ConfigError

__all__ = ["estimator_info", "loss_reads_teacher", "uses_critic"]


def estimator_info(cfg: Config) -> dict[str, Any] | None:
    """What the configured estimator declared at registration (``requires``, ``grouped``,
    ``options``); None for a ``file.py:name`` spec, which is judged once it is loaded."""
    name = cfg.algorithm.adv_estimator
    return ADV_ESTIMATORS.info(name) if name in ADV_ESTIMATORS else None


def _declares(cfg: Config, key: str, value: str | None = None) -> bool:
    """The estimator declares ``key`` (a flag), or ``value`` among ``key``'s names."""
    info = estimator_info(cfg)
    if info is None:
        return True
    return bool(info.get(key)) if value is None else value in info.get(key, ())


def _declared(registry: str, name: str, option: str) -> bool:
    """``name`` in ``creditrl.core``'s ``registry`` declared ``option`` among the settings it
    reads (``register_*(options=)``); an unknown name reads everything (it is refused
    elsewhere)."""
    entries = getattr(creditrl.core, registry)
    return name not in entries or option in entries.info(name).get("options", ())


def _loss_reads(cfg: Config, option: str) -> bool:
    """The configured policy loss declared ``option`` (``register_policy_loss(options=)``)."""
    return _declared("POLICY_LOSSES", cfg.actor.policy_loss, option)


def loss_reads_teacher(cfg: Config) -> bool:
    """The configured policy loss declared ``requires=("teacher_log_prob",)``."""
    name = cfg.actor.policy_loss
    return name in POLICY_LOSSES and "teacher_log_prob" in POLICY_LOSSES.info(name).get(
        "requires", ()
    )


def uses_critic(cfg: Config) -> bool:
    """The configured estimator requires ``values`` (so a critic is built)."""
    return _declares(cfg, "requires", "values")


@register_config_check("critic_batches")
def _check_critic_batches(cfg: Config) -> None:
    if uses_critic(cfg) and estimator_info(cfg) is not None:
        check_batches(cfg, "critic")


@register_config_check("estimator_groups")
def _check_estimator_groups(cfg: Config) -> None:
    alg, n = cfg.algorithm, cfg.rollout.n
    if estimator_info(cfg) is not None and _declares(cfg, "grouped") and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={alg.adv_estimator} compares the rollout.n answers to each "
            f"prompt; rollout.n={n} gives every advantage 0; set rollout.n >= 2 or use an "
            "estimator without groups (gae, reinforce_plus_plus, remax)"
        )


register_unused_rule(
    "critic",
    applies=lambda c: not uses_critic(c),
    keys=("critic.", "model.critic_path", "trainer.critic_warmup", "trainer.critic_placement"),
    reason=lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} uses no critic",
)
register_unused_rule(
    "distill_reward_shaping",
    applies=lambda c: c.distill.teacher is not None and loss_reads_teacher(c),
    keys=("distill.coef", "distill.combine"),
    reason=lambda c: (
        f"actor.policy_loss={c.actor.policy_loss} trains on the teacher's log-probs "
        "alone (these shape the rewards it does not read)"
    ),
)
for _key in ("target_kl", "horizon"):
    register_unused_rule(
        f"kl_ctrl_{_key}",
        applies=lambda c, key=_key: not _declared("KL_CONTROLLERS", c.algorithm.kl_ctrl.type, key),
        keys=(f"algorithm.kl_ctrl.{_key}",),
        reason=lambda c: f"algorithm.kl_ctrl.type={c.algorithm.kl_ctrl.type}",
    )
register_unused_rule(
    "lam",
    applies=lambda c: not _declares(c, "options", "lam"),
    keys=("algorithm.lam",),
    reason=lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} has no lambda",
)
register_unused_rule(
    "gamma",
    applies=lambda c: not _declares(c, "options", "gamma"),
    keys=("algorithm.gamma",),
    reason=lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} does not discount",
)
register_unused_rule(
    "norm_adv_by_std_in_grpo",
    applies=lambda c: not _declares(c, "options", "norm_adv_by_std_in_grpo"),
    keys=("algorithm.norm_adv_by_std_in_grpo",),
    reason=lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} divides by no group std",
)
register_unused_rule(
    "clip_ratio_c",
    applies=lambda c: not _loss_reads(c, "clip_ratio_c"),
    keys=("actor.clip_ratio_c",),
    reason=lambda c: f"actor.policy_loss={c.actor.policy_loss} has no dual clip",
)
register_unused_rule(
    "sapo_gate",
    applies=lambda c: not _loss_reads(c, "tau_pos"),
    keys=("actor.tau_pos", "actor.tau_neg"),
    reason=lambda c: f"actor.policy_loss={c.actor.policy_loss} is not sapo (it has no gate)",
)
register_unused_rule(
    "loss_scale_factor",
    applies=lambda c: not _declared("LOSS_AGG_MODES", c.actor.loss_agg_mode, "loss_scale_factor"),
    keys=("actor.loss_scale_factor",),
    reason=lambda c: f"actor.loss_agg_mode={c.actor.loss_agg_mode} divides by no constant",
)
