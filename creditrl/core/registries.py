"""``creditrl.core``'s registries: every built-in estimator, loss, aggregation, KL estimator and
KL controller by name, with the dotted path of its definition and what it declares, so a config
is checked without importing torch; the definitions are imported when first asked for.

The ``register_*`` decorators add user code (a ``trainer.extensions`` module, a test) to the
same registries; ``get_*`` return the object.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from creditrl.config.schema import REWARD_DISTRIBUTIONS, ROLLOUT_IS_LEVELS, ROLLOUT_IS_MODES
from creditrl.registry import Registry

__all__ = [
    "ADV_ESTIMATORS",
    "CLIP_OPTIONS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "REWARD_DISTRIBUTIONS",
    "ROLLOUT_IS_LEVELS",
    "ROLLOUT_IS_MODES",
    "get_advantage_estimator",
    "get_policy_loss",
    "register_adv_est",
    "register_kl_controller",
    "register_loss_agg",
    "register_policy_loss",
]

Fn = Callable[..., Any]

CLIP_OPTIONS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high")  # the trust region's sides

ADV_ESTIMATORS: Registry[Fn] = Registry("advantage estimator")
POLICY_LOSSES: Registry[Fn] = Registry("policy loss")
KL_ESTIMATORS: Registry[Fn] = Registry("KL estimator")
KL_CONTROLLERS: Registry[Fn] = Registry("kl_ctrl type")
LOSS_AGG_MODES: Registry[Fn] = Registry("loss_agg_mode")


def _estimator(
    name: str,
    attr: str,
    requires: tuple[str, ...] = (),
    grouped: bool = False,
    options: tuple[str, ...] = (),
) -> None:
    path = f"creditrl.core.advantages:{attr}"
    ADV_ESTIMATORS.add(name, path, requires=requires, grouped=grouped, options=options)


_GRPO = ("norm_adv_by_std_in_grpo",)
_estimator("gae", "_gae", requires=("values",), options=("gamma", "lam"))
_estimator("grpo", "compute_grpo_outcome_advantage", grouped=True, options=_GRPO)
_estimator("grpo_multiturn", "compute_grpo_multiturn_advantage", grouped=True, options=_GRPO)
_estimator("dr_grpo", "compute_dr_grpo_outcome_advantage", grouped=True)
_estimator("rloo", "compute_rloo_outcome_advantage", grouped=True)
_estimator("opo", "compute_opo_outcome_advantage", grouped=True)
_estimator("gpg", "compute_gpg_outcome_advantage", grouped=True)
_estimator("grpo_passk", "compute_grpo_passk_outcome_advantage", grouped=True, options=_GRPO)
_estimator(
    "reinforce_plus_plus", "compute_reinforce_plus_plus_outcome_advantage", options=("gamma",)
)
_estimator(
    "reinforce_plus_plus_baseline",
    "compute_reinforce_plus_plus_baseline_outcome_advantage",
    grouped=True,
)
_estimator("remax", "compute_remax_outcome_advantage", requires=("reward_baselines",))

_PL = "creditrl.core.policy_losses"
_PPO = (*CLIP_OPTIONS, "clip_ratio_c")
POLICY_LOSSES.add("ppo", f"{_PL}:compute_policy_loss_ppo", "vanilla", options=_PPO, requires=())
POLICY_LOSSES.add("gspo", f"{_PL}:compute_policy_loss_gspo", options=CLIP_OPTIONS, requires=())
POLICY_LOSSES.add("cispo", f"{_PL}:compute_policy_loss_cispo", options=CLIP_OPTIONS, requires=())
POLICY_LOSSES.add("gpg", f"{_PL}:compute_policy_loss_gpg", options=(), requires=())
POLICY_LOSSES.add(
    "sapo", f"{_PL}:compute_policy_loss_sapo", options=("tau_pos", "tau_neg"), requires=()
)
POLICY_LOSSES.add(
    "distill",
    "creditrl.core.distill:compute_policy_loss_distill",
    options=(),
    requires=("teacher_log_prob",),
)

KL_ESTIMATORS.add("k1", "creditrl.core.kl:_k1", "kl")
KL_ESTIMATORS.add("abs", "creditrl.core.kl:_abs")
KL_ESTIMATORS.add("k2", "creditrl.core.kl:_k2", "mse")
KL_ESTIMATORS.add("k3", "creditrl.core.kl:_k3", "low_var_kl")

KL_CONTROLLERS.add("fixed", "creditrl.core.kl:_fixed", options=())
KL_CONTROLLERS.add("adaptive", "creditrl.core.kl:_adaptive", options=("target_kl", "horizon"))

_AGG = "creditrl.core.aggregation"
LOSS_AGG_MODES.add("token-mean", f"{_AGG}:_token_mean", options=())
LOSS_AGG_MODES.add("token-sum", f"{_AGG}:_token_sum", options=())
LOSS_AGG_MODES.add("seq-mean-token-sum", f"{_AGG}:_seq_mean_token_sum", options=())
LOSS_AGG_MODES.add("seq-mean-token-mean", f"{_AGG}:_seq_mean_token_mean", options=())
LOSS_AGG_MODES.add(
    "seq-mean-token-sum-norm", f"{_AGG}:_seq_mean_token_sum_norm", options=("loss_scale_factor",)
)


def register_adv_est(
    name: str,
    *aliases: str,
    requires: tuple[str, ...] = (),
    grouped: bool = False,
    options: tuple[Any, ...] = (),
) -> Callable[[Fn], Fn]:
    """Decorator: register an advantage estimator under ``name`` (and ``aliases``).

    It is called with keyword arguments only, as verl calls its estimators:
    ``fn(token_level_rewards=, response_mask=, index=, **options)``, so parameters may come in
    any order (verl's GAE takes ``values`` second); a function without ``**kwargs`` gets only
    the names it takes. It returns ``(advantages, returns)``, each (B, T). It declares what the
    trainer must build for it:

    - ``requires``: catalogue fields it reads beyond rewards, mask and uid: ``values`` (a
      critic is built and trained), ``reward_baselines`` (the greedy baseline rollout),
      ``turn_scores`` / ``global_scores`` (a structured reward), ``token_level_scores``;
    - ``grouped``: it compares the answers to one prompt (``rollout.n`` >= 2 and sampling
      with a temperature are required);
    - ``options``: the ``algorithm.*`` settings it reads (``gamma``, ``lam``,
      ``norm_adv_by_std_in_grpo``); a key it does not read draws a warning when set.
    """
    return ADV_ESTIMATORS.register(
        name, *aliases, requires=tuple(requires), grouped=grouped, options=tuple(options)
    )


def register_policy_loss(
    name: str, *aliases: str, options: tuple[Any, ...] = (), requires: tuple[str, ...] = ()
) -> Callable[[Fn], Fn]:
    """Decorator: register a policy loss under ``name`` and each alias. ``options``: the
    ``actor.*`` settings it reads from its ``PolicyLossConfig`` (``clip_ratio_c``, ``tau_pos``,
    ...; one it does not read draws a warning when set, and ``explain`` shows only these), and
    ``creditrl.config.Option``s of its own, set as ``actor.policy_loss_kwargs.NAME`` and read
    as ``config.kwargs[NAME]``. ``requires``: further (B, T) batch fields it reads, passed as
    keyword arguments of those names (``("teacher_log_prob",)`` for ``distill``)."""
    return POLICY_LOSSES.register(name, *aliases, options=tuple(options), requires=tuple(requires))


def register_kl_controller(name: str, *, options: tuple[Any, ...] = ()) -> Callable[[Fn], Fn]:
    """Decorator: register ``factory(kl_coef=, target_kl=, horizon=)`` -> controller (with
    ``value``, ``update``, ``state_dict``, ``load_state_dict``) under ``name``. ``options``:
    the ``algorithm.kl_ctrl.*`` settings besides ``kl_coef`` it reads; one it does not read
    draws a warning when set."""
    return KL_CONTROLLERS.register(name, options=tuple(options))


def register_loss_agg(name: str, *, options: tuple[Any, ...] = ()) -> Callable[[Fn], Fn]:
    """Decorator: register an aggregation ``fn(token_sums, mask, num_tokens, num_seqs,
    scale) -> loss`` under ``name`` (``agg_loss`` passes the per-sequence sums of l m, the
    mask, N and S, local or global, and ``loss_scale_factor``). ``options``: the
    ``actor.*``/``critic.*`` settings it reads (``loss_scale_factor``); one it does not read
    draws a warning when set."""
    return LOSS_AGG_MODES.register(name, options=tuple(options))


def get_advantage_estimator(name: str) -> Fn:
    """The estimator registered as ``name`` (e.g. ``gae``, ``grpo``, ``rloo``)."""
    return ADV_ESTIMATORS.get(name)


def get_policy_loss(name: str) -> Fn:
    """The policy loss registered as ``name``; KeyError listing the choices otherwise."""
    return POLICY_LOSSES.get(name)
