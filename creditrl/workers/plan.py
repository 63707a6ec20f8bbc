"""Which models and stages a config needs, derived from what its registered estimator declares
(``creditrl.core.register_adv_est(..., requires=...)``): no module decides by a name.

Read by the workers and worker groups (which models to build), the step pipeline (which stages
to run), the async sampler and learner and the preflight, so it stands in the lowest of those
layers; it reads only the config, the core's registries and the rollout strategy's traits."""

from __future__ import annotations

from dataclasses import dataclass

from creditrl.config import Config
from creditrl.core import ADV_ESTIMATORS
from creditrl.rollout.strategies import strategy_traits
from creditrl.usercode import resolve_adv_estimator

__all__ = ["Plan", "structured_reward"]


def structured_reward(cfg: Config) -> bool:
    """The run scores with spec 001's structured reward manager (turn and global scores): an
    agent run of the built-in loop with ``agent.reward_manager=structured`` (an
    ``agent.program`` run is scored by its program or the rule scorers)."""
    return strategy_traits(cfg).uses_tools and cfg.agent.reward_manager == "structured"


@dataclass(frozen=True)
class Plan:
    """What one run builds and runs.

    - ``estimator``: the registered name of ``algorithm.adv_estimator`` (a ``file.py:name``
      spec is imported first);
    - ``needs_critic``: the estimator requires ``values``: a critic is built, evaluated and
      trained;
    - ``needs_greedy_baseline``: it requires ``reward_baselines``: the greedy response to each
      prompt is generated and scored (ReMax);
    - ``grouped``: it compares the ``rollout.n`` answers to one prompt;
    - ``options``: the ``algorithm.*`` settings it reads;
    - ``needs_ref``: the reference policy's log-probs are needed (KL in the reward or loss);
    - ``structured_reward``: the reward is spec 001's structured one (``structured_reward``);
    - ``needs_teacher``: a distillation teacher scores the sampled tokens (``distill.teacher``).
    """

    estimator: str
    needs_critic: bool
    needs_greedy_baseline: bool
    grouped: bool
    options: tuple[str, ...]
    needs_ref: bool
    structured_reward: bool
    needs_teacher: bool = False

    @classmethod
    def from_config(cls, cfg: Config) -> Plan:
        """The plan of ``cfg`` (imports a user estimator file if the config names one)."""
        name = resolve_adv_estimator(cfg.algorithm.adv_estimator)
        info = ADV_ESTIMATORS.info(name)
        requires = set(info.get("requires", ()))
        return cls(
            estimator=name,
            needs_critic="values" in requires,
            needs_greedy_baseline="reward_baselines" in requires,
            grouped=bool(info.get("grouped", False)),
            options=tuple(info.get("options", ())),
            needs_ref=cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss,
            structured_reward=structured_reward(cfg),
            needs_teacher=cfg.distill.teacher is not None,
        )
