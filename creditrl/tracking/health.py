"""Training-health checks on the update's metrics: spec 004's "PPO statistics that defy
intuition".

In an on-policy update, ``old_log_probs`` are the current policy's own log-probs of the very
ids it sampled, so on the first mini-batch (before any optimizer step) the ratio
π_θ / π_old is 1 on every token: its ``ppo_kl`` (mean of log π_old - log π_θ) and clip fraction
must be ~0. When they are not, the log-probs the loss compares were computed on different
things, and the usual causes are listed in the warning.

The actor reports ``health/first_minibatch_ppo_kl`` and ``health/first_minibatch_clipfrac``;
``FirstMinibatchMonitor.check(metrics)`` adds ``health/first_minibatch_alarm`` (0 or 1) to the
metrics and returns a warning text the first time the alarm goes off (later alarms are
counted in ``health/first_minibatch_alarms`` but not repeated).
"""

from __future__ import annotations

from collections.abc import MutableMapping

__all__ = [
    "BF16_TOLERANCES",
    "FIRST_MINIBATCH_CLIPFRAC",
    "FIRST_MINIBATCH_KL",
    "FirstMinibatchMonitor",
    "first_minibatch_warning",
]

FIRST_MINIBATCH_KL = "health/first_minibatch_ppo_kl"
FIRST_MINIBATCH_CLIPFRAC = "health/first_minibatch_clipfrac"
# (ppo_kl, clip fraction) tolerances under bf16 autocast. Measured on SmolLM2-135M, multi-turn
# calculator rollouts at temperature 0.7: the engine's log-probs equal float32 recomputation to
# 2e-5, but bf16 ones differ per token by 0.03 on average and up to 0.36, which gave first
# mini-batches (4 trajectories, ~100 tokens) |ppo_kl| up to 0.049 and clip fractions up to
# 0.05. Log-probs recomputed at temperature 1 instead of 0.7 on the same batch: ppo_kl 0.043
# but clip fraction 0.26, so either test alone is not enough.
BF16_TOLERANCES = (0.1, 0.1)

LIKELY_CAUSES = (
    "rollout/trainer log-prob mismatch: old_log_probs taken from a rollout engine whose "
    "numerics differ from the trainer's (another engine, dtype or kernels; see "
    "actor.use_rollout_log_probs, actor.autocast)",
    "re-tokenisation: the trained ids are not the sampled ids (decode -> encode or chat-template "
    "re-rendering; see the tokenization/* metrics and `creditrl check-tokenization`)",
    "dropout on: the log-prob passes and the update run the model with different dropout "
    "states (model.train() with dropout > 0)",
    "temperature not applied: the rollout sampled at rollout.temperature but log-probs were "
    "recomputed at another temperature (or top-k/top-p filtered the sampling distribution)",
)


def first_minibatch_warning(
    metrics: MutableMapping[str, float],
    *,
    on_policy: bool = True,
    kl_tol: float = 1e-3,
    clipfrac_tol: float = 1e-3,
) -> str | None:
    """A warning text if the first mini-batch of an on-policy update has |ppo_kl| > ``kl_tol``
    or clip fraction > ``clipfrac_tol``; None otherwise, off-policy, or without the metrics.

    The defaults suit a float32 update (the ratio is then 1 to ~1e-5); with bf16 autocast use
    ``BF16_TOLERANCES`` (see ``FirstMinibatchMonitor.for_autocast``).
    """
    kl = metrics.get(FIRST_MINIBATCH_KL)
    clipfrac = metrics.get(FIRST_MINIBATCH_CLIPFRAC, 0.0)
    if not on_policy or kl is None:
        return None
    if abs(kl) <= kl_tol and clipfrac <= clipfrac_tol:
        return None
    causes = "\n".join(f"  - {cause}" for cause in LIKELY_CAUSES)
    return (
        f"on-policy update, yet its first mini-batch has ppo_kl={kl:.3g} and clip fraction="
        f"{clipfrac:.3g} (both should be ~0: the ratio is 1 before any optimizer step). "
        f"Likely causes:\n{causes}"
    )


class FirstMinibatchMonitor:
    """Runs ``first_minibatch_warning`` every step; see the module docstring."""

    def __init__(self, kl_tol: float = 1e-3, clipfrac_tol: float = 1e-3) -> None:
        self.kl_tol = kl_tol
        self.clipfrac_tol = clipfrac_tol
        self.alarms = 0

    @classmethod
    def for_autocast(cls, autocast: str) -> FirstMinibatchMonitor:
        """Tolerances for the update's precision (``actor.autocast``): ``BF16_TOLERANCES`` for
        "bf16", the float32 defaults otherwise."""
        return cls(*BF16_TOLERANCES) if autocast == "bf16" else cls()

    def check(self, metrics: MutableMapping[str, float], on_policy: bool = True) -> str | None:
        """Add the alarm metrics to ``metrics``; the warning text on the first alarm only."""
        if FIRST_MINIBATCH_KL not in metrics:
            return None
        text = first_minibatch_warning(
            metrics, on_policy=on_policy, kl_tol=self.kl_tol, clipfrac_tol=self.clipfrac_tol
        )
        metrics["health/first_minibatch_alarm"] = float(text is not None)
        self.alarms += text is not None
        metrics["health/first_minibatch_alarms"] = float(self.alarms)
        return text if text is not None and self.alarms == 1 else None
