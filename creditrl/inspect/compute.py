"""Per-token quantities for explain views, each computed by its one defining function in
``creditrl.core`` (nothing here re-derives the math).

All tensors are (B, T) with column j = step t = j + 1 (docs/architecture.md). ``derive`` fills the
columns that follow from the ones given: kl (``core.kl_penalty``), the distillation term
(``core.distill_term``), δ (GAE with λ = 0), the raw GAE advantage and its return, ratio and
clip flag (the configured core policy loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from creditrl.config import Config
from creditrl.core import (
    ADV_ESTIMATORS,
    POLICY_LOSSES,
    PolicyLossConfig,
    apply_kl_penalty,
    compute_advantage,
    compute_gae_advantage_return,
    distill_term,
    get_policy_loss,
    kl_penalty,
    log_ratio,
)
from creditrl.inspect.view import TokenView
from creditrl.workers.actor import policy_loss_config

__all__ = ["Settings", "derive", "rewards_from_scores", "run_estimator", "to_views"]

Tensors = dict[str, torch.Tensor]


@dataclass
class Settings:
    """The knobs the derived columns depend on (verl/creditrl config names)."""

    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    kl_in: str | None = None  # "reward" (use_kl_in_reward), "loss" (use_kl_loss) or None
    kl_estimator: str = "kl"  # algorithm.kl_penalty (reward) or actor.kl_loss_type (loss)
    beta: float = 0.0  # KL coefficient: kl_ctrl value (reward) or actor.kl_loss_coef (loss)
    policy_loss: str = "ppo"
    clip: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    temperature: float = 1.0
    distill_coef: float | None = None  # distill.coef with a teacher; None: no distillation
    distill_combine: str = "add"  # distill.combine: add to the task reward, or replace it

    @property
    def needs_values(self) -> bool:
        """The estimator declared ``requires=("values",)`` (a critic's V(s_t))."""
        return "values" in ADV_ESTIMATORS.info(self.adv_estimator).get("requires", ())

    @property
    def grouped(self) -> bool:
        """The estimator compares the answers to one prompt."""
        return bool(ADV_ESTIMATORS.info(self.adv_estimator).get("grouped", False))

    @classmethod
    def from_config(cls, cfg: Config, beta: float | None = None) -> Settings:
        """From a Config; ``beta`` overrides the KL coefficient (e.g. the adaptive controller's
        value logged for a step as ``actor/reward_kl_penalty_coeff``)."""
        alg, actor = cfg.algorithm, cfg.actor
        if alg.use_kl_in_reward:
            kl_in, estimator, coef = "reward", alg.kl_penalty, alg.kl_ctrl.kl_coef
        elif actor.use_kl_loss:
            kl_in, estimator, coef = "loss", actor.kl_loss_type, actor.kl_loss_coef
        else:
            kl_in, estimator, coef = None, alg.kl_penalty, 0.0
        return cls(
            adv_estimator=alg.adv_estimator,
            gamma=alg.gamma,
            lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
            kl_in=kl_in,
            kl_estimator=estimator,
            beta=coef if beta is None else float(beta),
            policy_loss=actor.policy_loss,
            clip=policy_loss_config(actor),
            temperature=cfg.rollout.temperature,
            distill_coef=None if cfg.distill.teacher is None else cfg.distill.coef,
            distill_combine=cfg.distill.combine,
        )

    def describe(self) -> dict[str, Any]:
        """The settings as shown above a view."""
        out: dict[str, Any] = {
            "adv_estimator": self.adv_estimator,
            "gamma": self.gamma,
            "lam": self.lam,
            "kl": f"{self.kl_estimator} estimator, in the {self.kl_in}" if self.kl_in else "none",
            "beta": self.beta,
            "policy_loss": self.policy_loss,
            "clip_ratio": [self.clip.low, self.clip.high],
        }
        if "clip_ratio_c" in POLICY_LOSSES.info(self.policy_loss).get("options", ()):
            out["clip_ratio_c"] = self.clip.clip_ratio_c
        if self.distill_coef is not None:
            out["distill"] = f"coef {self.distill_coef}, {self.distill_combine} the task reward"
        return out


def rewards_from_scores(t: Tensors, s: Settings) -> tuple[torch.Tensor, dict[str, float]]:
    """token_level_rewards from ``score`` (and ``old_log_prob``, ``ref_log_prob`` when KL is in
    the reward), by ``core.apply_kl_penalty``; otherwise the scores themselves. With a teacher
    (``teacher_log_prob`` given), coef·d_t (``core.distill_term``) is added, and with
    ``combine=replace`` the scores are taken out, as the pipeline's distillation stage does."""
    mask = t["mask"].to(t["score"].dtype)
    metrics: dict[str, float] = {}
    if s.kl_in != "reward":
        rewards = t["score"] * mask
    else:
        rewards, metrics = apply_kl_penalty(
            t["score"], t["old_log_prob"], t["ref_log_prob"], mask, s.beta, s.kl_estimator
        )
    if s.distill_coef is not None and "teacher_log_prob" in t:
        if s.distill_combine == "replace":
            rewards = rewards - t["score"] * mask
        d = distill_term(t["teacher_log_prob"], t["old_log_prob"], mask)
        rewards = rewards + s.distill_coef * d
    return rewards, metrics


def run_estimator(t: Tensors, s: Settings, index: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) by the configured estimator (``core.compute_advantage``)."""
    return compute_advantage(
        s.adv_estimator,
        t["reward"],
        t["mask"],
        index,
        values=t.get("value"),
        gamma=s.gamma,
        lam=s.lam,
        norm_adv_by_std_in_grpo=s.norm_adv_by_std_in_grpo,
    )


def clip_flags(t: Tensors, s: Settings) -> torch.Tensor:
    """1 where the configured policy loss gives token (i, t) no gradient although A != 0: the
    core loss is summed over tokens (``token-sum``) and differentiated w.r.t. log π_θ."""
    log_prob = t["log_prob"].detach().clone().requires_grad_(True)
    extra = {name: t[name] for name in POLICY_LOSSES.info(s.policy_loss).get("requires", ())}
    loss, _ = get_policy_loss(s.policy_loss)(
        t["old_log_prob"], log_prob, t["advantage"], t["mask"], "token-sum", s.clip, **extra
    )
    (grad,) = torch.autograd.grad(loss, log_prob, allow_unused=True)
    if grad is None:
        grad = torch.zeros_like(log_prob)
    flags = (grad == 0) & (t["advantage"] != 0) & t["mask"].bool()
    return flags.to(torch.int64)


def derive(t: Tensors, s: Settings) -> list[str]:
    """Add to ``t`` every column that follows from those present; returns notes on
    inconsistencies found (e.g. dumped returns that the given γ, λ do not reproduce).

    - ``kl`` from old/ref log-probs: ``core.kl_penalty`` with ``s.kl_estimator``, times mask;
    - ``distill`` from old/teacher log-probs: ``core.distill_term``;
    - ``delta`` from reward and value: ``compute_gae_advantage_return`` with λ = 0 (then
      A_t = δ_t exactly, masked spans skipped);
    - ``advantage_raw`` (GAE only) and, if absent, ``return``: the same function with ``s.lam``
      and ``whiten=False``;
    - ``ratio`` = exp(core's clamped log π_θ - log π_old) and ``clipped`` (``clip_flags``) from
      ``log_prob``, ``old_log_prob`` and ``advantage``.
    """
    notes: list[str] = []
    mask = t["mask"]
    if "old_log_prob" in t and "ref_log_prob" in t and "kl" not in t:
        t["kl"] = kl_penalty(t["old_log_prob"], t["ref_log_prob"], s.kl_estimator) * mask
    if "old_log_prob" in t and "teacher_log_prob" in t and "distill" not in t:
        t["distill"] = distill_term(t["teacher_log_prob"], t["old_log_prob"], mask)
    if "reward" in t and "value" in t:
        t["delta"], _ = compute_gae_advantage_return(
            t["reward"], t["value"], mask, s.gamma, 0.0, whiten=False
        )
        if s.needs_values:
            raw, returns = compute_gae_advantage_return(
                t["reward"], t["value"], mask, s.gamma, s.lam, whiten=False
            )
            t["advantage_raw"] = raw
            if "return" in t:
                gap = float(torch.nan_to_num((returns - t["return"]) * mask, nan=1.0).abs().max())
                if gap > 1e-4:
                    notes.append(
                        f"returns recomputed with gamma={s.gamma}, lam={s.lam} differ from the "
                        f"stored ones by up to {gap:.3g}: pass the run's algorithm.gamma and "
                        "algorithm.lam"
                    )
            else:
                t["return"] = returns
    if "log_prob" in t and "old_log_prob" in t:
        t["ratio"] = torch.exp(log_ratio(t["old_log_prob"], t["log_prob"])) * mask
        needs = POLICY_LOSSES.info(s.policy_loss).get("requires", ())
        if "advantage" in t and all(name in t for name in needs):
            t["clipped"] = clip_flags(t, s)
    return notes


def to_views(
    t: Tensors,
    lengths: list[int],
    tokens: list[list[str]],
    titles: list[str],
    *,
    ids: list[list[int]] | None = None,
    prompts: list[str | None] | None = None,
    settings: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> list[TokenView]:
    """One TokenView per row: row i's first ``lengths[i]`` columns of every tensor in ``t``."""
    views = []
    for i, length in enumerate(lengths):
        columns: dict[str, list[Any]] = {}
        for name, tensor in t.items():
            row = tensor[i, :length]
            if row.is_floating_point():
                columns[name] = [float(v) for v in row.to(torch.float64).tolist()]
            else:
                columns[name] = [int(v) for v in row.tolist()]
        if ids is not None:
            columns["id"] = list(ids[i][:length])
        views.append(
            TokenView(
                title=titles[i],
                tokens=list(tokens[i][:length]),
                columns=columns,
                prompt=None if prompts is None else prompts[i],
                settings=dict(settings or {}),
                notes=list(notes or []),
            )
        )
    return views
