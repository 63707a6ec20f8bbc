"""KL estimators between the policy and the reference, per token, and KL coefficient controllers.

Index convention: ``logprob[:, j]`` = log pi(y_{j+1} | s_{j+1}) and ``ref_logprob[:, j]`` =
log pi_ref(y_{j+1} | s_{j+1}); every estimator returns kl_j for the same step t = j + 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from creditrl.core.registries import KL_CONTROLLERS, KL_ESTIMATORS, register_kl_controller

__all__ = [
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "FixedKLController",
    "get_kl_controller",
    "kl_penalty",
    "register_kl_controller",
]

KLFn = Callable[..., torch.Tensor]


def _k1(logprob: torch.Tensor, ref_logprob: torch.Tensor, **_: object) -> torch.Tensor:
    """k1_t = log pi(a_t|s_t) - log pi_ref(a_t|s_t): unbiased, can be negative."""
    return logprob - ref_logprob


def _abs(logprob: torch.Tensor, ref_logprob: torch.Tensor, **_: object) -> torch.Tensor:
    """|log pi - log pi_ref|."""
    return (logprob - ref_logprob).abs()


def _k2(logprob: torch.Tensor, ref_logprob: torch.Tensor, **_: object) -> torch.Tensor:
    """k2_t = 0.5 * (log pi - log pi_ref)^2."""
    return 0.5 * (logprob - ref_logprob).square()


def _k3(logprob: torch.Tensor, ref_logprob: torch.Tensor, **_: object) -> torch.Tensor:
    """k3_t = exp(x) - x - 1 with x = log pi_ref - log pi (Schulman's low-variance estimator).

    x is clamped to [-20, 20] before exp and the result to [-10, 10], for stability.
    """
    x = (ref_logprob - logprob).clamp(-20.0, 20.0)
    return (torch.exp(x) - x - 1.0).clamp(-10.0, 10.0)


def kl_penalty(
    logprob: torch.Tensor,
    ref_logprob: torch.Tensor,
    kl_penalty: str = "k1",
) -> torch.Tensor:
    """Per-token KL estimate kl_t (B, T) by estimator name (verl's ``kl_penalty``).

    Names: ``k1``/``kl``, ``abs``, ``k2``/``mse``, ``k3``/``low_var_kl``. A trailing
    ``+`` (``k1+``, ``k3+``, ...) is the straight-through variant: its value is the named
    estimator's, its gradient is k2's: k2 + sg(named - k2). Masking is the caller's.
    """
    straight_through = kl_penalty.endswith("+")
    name = kl_penalty[:-1] if straight_through else kl_penalty
    value = KL_ESTIMATORS.get(name)(logprob, ref_logprob)
    if not straight_through:
        return value
    k2 = _k2(logprob, ref_logprob)
    return k2 + (value - k2).detach()


@dataclass
class FixedKLController:
    """beta stays at ``kl_coef``."""

    kl_coef: float

    @property
    def value(self) -> float:
        return self.kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient is fixed."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Nothing to restore: the coefficient is fixed by the config."""


@dataclass
class AdaptiveKLController:
    """Ziegler et al. (2019): e = clip(kl / target - 1, -0.2, 0.2); beta <- beta (1 + e n / H)."""

    init_kl_coef: float
    target_kl: float
    horizon: float

    def __post_init__(self) -> None:
        if self.target_kl <= 0 or self.horizon <= 0:
            raise ValueError(
                f"adaptive KL needs target_kl > 0 and horizon > 0, got {self.target_kl}, "
                f"{self.horizon}"
            )
        self.value = float(self.init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta toward the target: n_steps samples were seen at mean KL ``current_kl``."""
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Continue from a checkpointed beta."""
        self.value = float(state["value"])


KLControllerFactory = Callable[..., Any]


def _fixed(kl_coef: float, **_: float) -> FixedKLController:
    return FixedKLController(kl_coef)


def _adaptive(kl_coef: float, target_kl: float, horizon: float) -> AdaptiveKLController:
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def get_kl_controller(
    kl_ctrl_type: str = "fixed",
    kl_coef: float = 0.001,
    target_kl: float = 0.1,
    horizon: float = 10000,
) -> Any:
    """The controller registered as ``kl_ctrl_type`` (verl's ``algorithm.kl_ctrl.type``:
    ``fixed`` or ``adaptive``)."""
    if kl_ctrl_type not in KL_CONTROLLERS:
        raise ValueError(
            f"unknown kl_ctrl type {kl_ctrl_type!r}; choose one of {KL_CONTROLLERS.names()}"
        )
    return KL_CONTROLLERS.get(kl_ctrl_type)(kl_coef=kl_coef, target_kl=target_kl, horizon=horizon)
