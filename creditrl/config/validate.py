"""Checks on a loaded Config, the one place a config is refused: each choice-valued key against
its choices, each number against its range, and combinations that cannot train (one-line
``ConfigError``s); settings the user gave that the chosen mode will not use (warnings).

``load_config`` runs them; a Config built directly in code is not checked. A key's choices and
range live on its field in ``schema.py`` (``creditrl.config.fields``); registry-backed choices
are read from the registries in ``creditrl.core`` when checked, so a user-registered estimator
or loss is accepted. Rules that relate several keys live here.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from creditrl.config.fields import (
    FLOAT32_MAX,
    Range,
    choices_of,
    choices_text,
    format_value,
    value_at,
)
from creditrl.config.options import resolve_options
from creditrl.config.schema import Config
from creditrl.errors import ConfigError
from creditrl.usercode import is_code_spec, load_user_module

__all__ = [
    "CHOICES",
    "RANGES",
    "Range",
    "all_choices",
    "format_value",
    "import_extensions",
    "schema_fields",
    "unused_settings",
    "uses_critic",
    "validate_config",
]


def _estimator(cfg: Config) -> dict[str, Any] | None:
    """What the configured estimator declared at registration (``requires``, ``grouped``,
    ``options``); None for a ``file.py:name`` spec, which is judged once it is loaded."""
    from creditrl.core import ADV_ESTIMATORS

    name = cfg.algorithm.adv_estimator
    return ADV_ESTIMATORS.info(name) if name in ADV_ESTIMATORS else None


def _declares(cfg: Config, key: str, value: str | None = None) -> bool:
    """The estimator declares ``key`` (a flag), or ``value`` among ``key``'s names."""
    info = _estimator(cfg)
    if info is None:
        return True
    return bool(info.get(key)) if value is None else value in info.get(key, ())


def _declared(cfg: Config, registry: str, name: str, option: str) -> bool:
    """``name`` in ``creditrl.core``'s ``registry`` declared ``option`` among the settings it
    reads (``register_*(options=)``); an unknown name reads everything (it is refused
    elsewhere)."""
    import creditrl.core

    entries = getattr(creditrl.core, registry)
    return name not in entries or option in entries.info(name).get("options", ())


def _strategy(cfg: Config) -> Any:
    """What the rollout strategy ``cfg`` selects declared (``creditrl.rollout.strategies``)."""
    from creditrl.rollout.strategies import strategy_traits

    return strategy_traits(cfg)


def _autocast(cfg: Config) -> str:
    """What ``actor.autocast`` resolves to for this config's update ('bf16' or 'none')."""
    from creditrl.workers.placement import update_autocast

    return update_autocast(cfg)


def _engine_traits(cfg: Config) -> Any:
    """What the configured engine declared (``register_rollout_engine``); the defaults for a
    name not registered (refused elsewhere)."""
    from creditrl.rollout import ROLLOUT_ENGINES
    from creditrl.rollout.engine import EngineTraits, engine_traits

    name = cfg.rollout.engine
    return engine_traits(name) if name in ROLLOUT_ENGINES else EngineTraits()


def _other_engines_options(cfg: Config) -> tuple[str, ...]:
    """The ``rollout.*`` keys that registered engines declare as their options and the
    configured engine does not."""
    from creditrl.rollout import ROLLOUT_ENGINES
    from creditrl.rollout.engine import engine_traits

    ours = set(_engine_traits(cfg).options)
    declared = {
        key
        for name in ROLLOUT_ENGINES
        for key in engine_traits(name).options
        if isinstance(key, str)  # an Option of its own lives under rollout.engine_kwargs
    }
    return tuple(f"rollout.{key}" for key in sorted(declared - ours))


def _loss_reads(cfg: Config, option: str) -> bool:
    """The configured policy loss declared ``option`` (``register_policy_loss(options=)``)."""
    return _declared(cfg, "POLICY_LOSSES", cfg.actor.policy_loss, option)


def _loss_reads_teacher(cfg: Config) -> bool:
    """The configured policy loss declared ``requires=("teacher_log_prob",)``."""
    from creditrl.core import POLICY_LOSSES

    name = cfg.actor.policy_loss
    return name in POLICY_LOSSES and "teacher_log_prob" in POLICY_LOSSES.info(name).get(
        "requires", ()
    )


def uses_critic(cfg: Config) -> bool:
    """The configured estimator requires ``values`` (so a critic is built)."""
    return _declares(cfg, "requires", "values")


def schema_fields(
    node: Any = None, prefix: str = ""
) -> Iterator[tuple[str, dataclasses.Field[Any], Any]]:
    """(dotted key, field, value) of every setting of ``node`` (default: ``Config()``),
    sections walked; a field's metadata holds its choices or range (``creditrl.config.fields``)."""
    node = Config() if node is None else node
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from schema_fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def _field_metadata() -> dict[str, Mapping[str, Any]]:
    """{dotted key: field metadata} of every setting that declares choices or a range."""
    return {key: f.metadata for key, f, _ in schema_fields() if f.metadata}


_METADATA = _field_metadata()
CHOICES: dict[str, tuple[str, ...]] = {
    key: tuple(meta["choices"]) for key, meta in _METADATA.items() if "choices" in meta
}
"""The fixed choice sets (registry-backed keys are in ``all_choices()``)."""
RANGES: dict[str, Range] = {
    key: meta["range"] for key, meta in _METADATA.items() if "range" in meta
}
"""Every numeric key's allowed range."""


def all_choices() -> dict[str, tuple[str, ...]]:
    """Every choice-valued key and its accepted values now (list keys: each entry)."""
    out = {key: choices_of(meta) for key, meta in _METADATA.items()}
    return {key: names for key, names in out.items() if names is not None}


def _nearest(value: str, choices: Collection[str]) -> str:
    """'; did you mean X?' for the closest choice (case-insensitive first), or ''."""
    same_case = [c for c in choices if c.lower() == value.lower()]
    close = same_case or difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_choices(cfg: Config) -> None:
    for key, choices in all_choices().items():
        meta = _METADATA[key]
        value = value_at(cfg, key)
        entries = value if isinstance(value, list) else [value]
        for entry in entries:
            if entry in choices or (meta.get("user_code") and is_code_spec(str(entry))):
                continue
            shown = f"{key}={format_value(entry)}"
            if isinstance(value, list):
                shown = f"{key} entry {format_value(entry)}"
            allowed = choices_text(meta, choices)
            raise ConfigError(f"{shown} is not one of {allowed}{_nearest(str(entry), choices)}")


def _check_numbers(cfg: Config) -> None:
    for key, _, value in schema_fields(cfg):
        numbers = value if isinstance(value, list) else [value]
        for number in numbers:
            if isinstance(number, float) and not math.isfinite(number):
                raise ConfigError(f"{key}={format_value(number)} is not a finite number")
            if isinstance(number, float) and abs(number) > FLOAT32_MAX:
                raise ConfigError(
                    f"{key}={format_value(number)} is beyond what float32 carries "
                    f"(+-{FLOAT32_MAX:.4g}), and the run computes in float32"
                )
    for key, allowed in RANGES.items():
        value = value_at(cfg, key)
        if value is None and allowed.null:
            continue
        if value is None or not allowed.holds(value):
            raise ConfigError(f"{key}={format_value(value)} must be {allowed.text()}")
    top_k = cfg.rollout.top_k
    if top_k != -1 and top_k < 1:
        raise ConfigError(f"rollout.top_k={top_k} must be -1 (off) or >= 1")
    for section in ("actor", "critic"):
        betas = value_at(cfg, f"{section}.optim.betas")
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ConfigError(
                f"{section}.optim.betas={betas} must be two numbers in [0, 1), e.g. [0.9, 0.999]"
            )


def _check_batches(cfg: Config, section: str) -> None:
    batch, n, workers = cfg.data.train_batch_size, cfg.rollout.n, cfg.trainer.workers
    mini = value_at(cfg, f"{section}.ppo_mini_batch_size")
    if mini > batch:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size={mini} is larger than data.train_batch_size={batch} "
            f"(both count prompts); set {section}.ppo_mini_batch_size <= {batch}"
        )
    if batch % mini:
        raise ConfigError(
            f"data.train_batch_size={batch} is not a multiple of {section}.ppo_mini_batch_size="
            f"{mini}: the last optimizer step would be partial; use a divisor of {batch}"
        )
    if (mini * n) % workers:
        raise ConfigError(
            f"{section}.ppo_mini_batch_size x rollout.n = {mini * n} trajectories must divide "
            f"evenly over trainer.workers={workers}"
        )


def _check_endpoint_host(cfg: Config) -> None:
    """agent.endpoint_host is a loopback address unless agent.endpoint_allow_remote=true (the
    endpoint speaks plain HTTP; '' and 0.0.0.0 would serve every interface)."""
    from creditrl.asynchronous.transport import is_loopback

    host = cfg.agent.endpoint_host
    if not is_loopback(host) and not cfg.agent.endpoint_allow_remote:
        raise ConfigError(
            f"agent.endpoint_host={host!r} is not a loopback address: the endpoint serves plain "
            "HTTP (the run's key in clear) on it; use 127.0.0.1, or set "
            "agent.endpoint_allow_remote=true"
        )


def _check_combinations(cfg: Config) -> None:
    alg, n = cfg.algorithm, cfg.rollout.n
    _check_endpoint_host(cfg)
    _check_batches(cfg, "actor")
    if uses_critic(cfg) and _estimator(cfg) is not None:
        _check_batches(cfg, "critic")
    if _estimator(cfg) is not None and _declares(cfg, "grouped") and n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={alg.adv_estimator} compares the rollout.n answers to each "
            f"prompt; rollout.n={n} gives every advantage 0; set rollout.n >= 2 or use an "
            "estimator without groups (gae, reinforce_plus_plus, remax)"
        )
    if alg.filter_groups.enable and n < 2:
        raise ConfigError(
            f"algorithm.filter_groups.enable=true keeps groups whose scores vary; rollout.n={n} "
            "makes groups of one, so nothing would be kept; set rollout.n >= 2"
        )
    lower, upper = alg.rollout_is.threshold_lower, alg.rollout_is.threshold
    if lower is not None and lower > upper:
        raise ConfigError(
            f"algorithm.rollout_is.threshold_lower={format_value(lower)} must be <= "
            f"algorithm.rollout_is.threshold={format_value(upper)}"
        )
    buffer, budget = alg.overlong_buffer, cfg.rollout.max_response_length
    if buffer.enable and buffer.len > budget:
        raise ConfigError(
            f"algorithm.overlong_buffer.len={buffer.len} must be <= "
            f"rollout.max_response_length={budget} (the buffer is the end of that budget)"
        )
    if cfg.trainer.backend == "local" and cfg.trainer.workers != 1:
        raise ConfigError(
            f"trainer.workers={cfg.trainer.workers} needs trainer.backend=ray "
            "(the local backend is one process)"
        )
    if cfg.model.lora_rank > 0 and not _engine_traits(cfg).supports_lora:
        raise ConfigError(
            f"rollout.engine={cfg.rollout.engine} with model.lora_rank > 0 is not supported yet"
        )
    if cfg.rollout.val_n > 1 and cfg.rollout.val_temperature == 0:
        raise ConfigError(
            f"rollout.val_n={cfg.rollout.val_n} with rollout.val_temperature=0 validates with "
            f"{cfg.rollout.val_n} identical greedy answers (pass@k would equal mean@1); set "
            "rollout.val_temperature > 0 or rollout.val_n=1"
        )
    static = cfg.rollout.engine_kwargs.get("decode_cache")
    if static == "static" and _strategy(cfg).multi_turn and cfg.agent.keep_kv_cache:
        raise ConfigError(
            "rollout.engine_kwargs.decode_cache=static decodes from a preallocated KV cache, "
            "which cannot keep a turn's KV for the next (agent.keep_kv_cache=true); set "
            "agent.keep_kv_cache=false or decode_cache=auto"
        )
    if cfg.rollout.engine_kwargs.get("sample_dtype") == "bfloat16" and _autocast(cfg) != "bf16":
        raise ConfigError(
            "rollout.engine_kwargs.sample_dtype=bfloat16 samples from a bf16 copy whose "
            "log-probs are not the update's, and actor.autocast resolves to none here (the "
            "update would reuse them as old_log_probs): set actor.autocast=bf16 or "
            "sample_dtype=model"
        )
    if not cfg.data.task and not cfg.data.train_files:
        raise ConfigError("no data: set data.task (a reasoning-gym name) or data.train_files")


def _check_paths(cfg: Config) -> None:
    model = cfg.model
    if model.path != "embedded" and not Path(model.path).is_dir():
        raise ConfigError(
            f"model.path={model.path!r} is neither 'embedded' nor an existing model directory"
        )
    if model.critic_path is not None and not Path(model.critic_path).is_dir():
        raise ConfigError(f"model.critic_path={model.critic_path!r} is not an existing directory")
    rm = cfg.reward.reward_model
    if rm.enable and (rm.path is None or not Path(rm.path).is_dir()):
        raise ConfigError(
            f"reward.reward_model.enable=true needs reward.reward_model.path to be a model "
            f"directory; got {format_value(rm.path)}"
        )


def _check_distill(cfg: Config) -> None:
    """``creditrl.config.teacher_check.check_distill`` with what the registries declare."""
    from creditrl.agents.tasks import AGENT_TASKS
    from creditrl.config.teacher_check import check_distill

    agent_task = cfg.data.task in AGENT_TASKS and not cfg.data.train_files
    check_distill(cfg, _loss_reads_teacher(cfg), agent_task)


def import_extensions(cfg: Config) -> None:
    """Import ``trainer.extensions`` (once per process), so what they register is known."""
    for target in cfg.trainer.extensions:
        load_user_module(target, "trainer.extensions")


def validate_config(cfg: Config, *, import_code: bool = True) -> None:
    """Raise a one-line ConfigError for the first setting ``cfg`` cannot train with, after
    importing ``trainer.extensions`` (unless ``import_code`` is false: a run's config read as
    data); fills in the options extensions declare (``creditrl.config.options``)."""
    if import_code:
        import_extensions(cfg)
    _check_choices(cfg)
    resolve_options(cfg)
    _check_numbers(cfg)
    _check_combinations(cfg)
    _check_paths(cfg)
    _check_distill(cfg)


# (condition under which the keys are unused, keys (a trailing '.' takes a section), reason)
PROGRAM_KEYS = tuple(
    f"agent.{k}"
    for k in ("max_concurrent_episodes", "episode_timeout_s", "endpoint_host", "endpoint_port",
              "endpoint_allow_remote")
)  # fmt: skip
BUILT_IN_LOOP_KEYS = tuple(
    f"agent.{k}"
    for k in ("max_turns", "tools", "tool_config", "tool_timeout_s", "max_parallel_calls",
              "max_calls_per_turn", "tool_output_max_chars", "truncate_side", "reward_manager",
              "reward_distribution")
)  # fmt: skip
UnusedRule = tuple[
    Callable[[Config], bool],
    tuple[str, ...] | Callable[[Config], tuple[str, ...]],
    Callable[[Config], str],
]
UNUSED_RULES: tuple[UnusedRule, ...] = (
    (
        lambda c: not uses_critic(c),
        ("critic.", "model.critic_path", "trainer.critic_warmup", "trainer.critic_placement"),
        lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} uses no critic",
    ),
    (
        lambda c: not _strategy(c).multi_turn,
        ("agent.",),
        lambda c: "agent.enable=false",
    ),
    (
        lambda c: _strategy(c).multi_turn and not _strategy(c).runs_program,
        PROGRAM_KEYS,
        lambda c: "agent.program is not set (these are its settings)",
    ),
    (
        lambda c: _strategy(c).multi_turn and not _strategy(c).uses_tools,
        BUILT_IN_LOOP_KEYS,
        lambda c: "agent.program runs its own loop and tools (these are the built-in loop's)",
    ),
    (
        lambda c: bool(c.data.train_files) or _strategy(c).multi_turn,
        ("data.few_shot",),
        lambda c: (
            "data.train_files holds the prompts"
            if c.data.train_files
            else "agent tasks show their own example (data.task_kwargs.few_shot)"
        ),
    ),
    (
        lambda c: not c.algorithm.use_kl_in_reward,
        ("algorithm.kl_ctrl.", "algorithm.kl_penalty"),
        lambda c: "algorithm.use_kl_in_reward=false",
    ),
    (
        lambda c: not c.actor.use_kl_loss,
        ("actor.kl_loss_type", "actor.kl_loss_coef"),
        lambda c: "actor.use_kl_loss=false",
    ),
    *(
        (
            lambda c, s=section: not value_at(c, f"algorithm.{s}.enable"),
            (f"algorithm.{section}.",),
            lambda c, s=section: f"algorithm.{s}.enable=false",
        )
        for section in ("rollout_is", "filter_groups", "overlong_buffer")
    ),
    (
        lambda c: c.distill.teacher is None,
        ("distill.",),
        lambda c: "distill.teacher is not set (no distillation)",
    ),
    (
        lambda c: c.distill.teacher is not None and _loss_reads_teacher(c),
        ("distill.coef", "distill.combine"),
        lambda c: (
            f"actor.policy_loss={c.actor.policy_loss} trains on the teacher's log-probs "
            "alone (these shape the rewards it does not read)"
        ),
    ),
    (
        lambda c: c.distill.teacher_prompt != "few_shot",
        ("distill.teacher_few_shot",),
        lambda c: f"distill.teacher_prompt={c.distill.teacher_prompt}",
    ),
    (
        lambda c: not c.reward.reward_model.enable,
        ("reward.reward_model.",),
        lambda c: "reward.reward_model.enable=false",
    ),
    (
        lambda c: True,
        lambda c: _other_engines_options(c),
        lambda c: f"rollout.engine={c.rollout.engine} (these settings are other engines')",
    ),
    (
        lambda c: c.trainer.backend == "local" and c.asynchronous.launcher != "ray",
        ("trainer.ray.", "trainer.critic_placement"),
        lambda c: "trainer.backend=local",
    ),
    (
        lambda c: c.model.lora_rank == 0,
        ("model.lora_alpha", "model.target_modules", "asynchronous.lora_sync"),
        lambda c: "model.lora_rank=0 (no LoRA)",
    ),
    *(
        (
            lambda c, key=key: not _declared(c, "KL_CONTROLLERS", c.algorithm.kl_ctrl.type, key),
            (f"algorithm.kl_ctrl.{key}",),
            lambda c: f"algorithm.kl_ctrl.type={c.algorithm.kl_ctrl.type}",
        )
        for key in ("target_kl", "horizon")
    ),
    (
        lambda c: not _declares(c, "options", "lam"),
        ("algorithm.lam",),
        lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} has no lambda",
    ),
    (
        lambda c: not _declares(c, "options", "gamma"),
        ("algorithm.gamma",),
        lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} does not discount",
    ),
    (
        lambda c: not _declares(c, "options", "norm_adv_by_std_in_grpo"),
        ("algorithm.norm_adv_by_std_in_grpo",),
        lambda c: f"algorithm.adv_estimator={c.algorithm.adv_estimator} divides by no group std",
    ),
    (
        lambda c: not _loss_reads(c, "clip_ratio_c"),
        ("actor.clip_ratio_c",),
        lambda c: f"actor.policy_loss={c.actor.policy_loss} has no dual clip",
    ),
    (
        lambda c: not _loss_reads(c, "tau_pos"),
        ("actor.tau_pos", "actor.tau_neg"),
        lambda c: f"actor.policy_loss={c.actor.policy_loss} is not sapo (it has no gate)",
    ),
    (
        lambda c: not _declared(c, "LOSS_AGG_MODES", c.actor.loss_agg_mode, "loss_scale_factor"),
        ("actor.loss_scale_factor",),
        lambda c: f"actor.loss_agg_mode={c.actor.loss_agg_mode} divides by no constant",
    ),
    (
        lambda c: c.algorithm.filter_groups.enable,
        ("reward.async_reward",),
        lambda c: (
            "algorithm.filter_groups.enable=true scores each generation batch before "
            "choosing groups, so scoring cannot overlap the log-prob pass"
        ),
    ),
    *(
        (
            lambda c, s=section: value_at(c, f"{s}.use_dynamic_bsz") is False,
            (f"{section}.max_token_len_per_device",),
            lambda c, s=section: f"{s}.use_dynamic_bsz=false",
        )
        for section in ("actor", "critic")
    ),
    *(
        (
            lambda c, s=section: value_at(c, f"{s}.optim.lr_scheduler") == "constant",
            (f"{section}.optim.min_lr_ratio",),
            lambda c, s=section: f"{s}.optim.lr_scheduler=constant",
        )
        for section in ("actor", "critic")
    ),
)


def unused_settings(cfg: Config, explicit: Collection[str]) -> list[str]:
    """One line per rule: the keys in ``explicit`` (given by the user) that ``cfg``'s mode will
    not use, with their values and why, e.g. "critic.optim.lr=1e-05 is set but
    algorithm.adv_estimator=grpo uses no critic"."""
    lines = []
    for applies, rule_keys, reason in UNUSED_RULES:
        if not applies(cfg):
            continue
        keys = rule_keys(cfg) if callable(rule_keys) else rule_keys
        hit = sorted(
            key
            for key in explicit
            if any(key.startswith(k) if k.endswith(".") else key == k for k in keys)
            and not key.endswith(".enable")
        )
        if hit:
            verb = "is" if len(hit) == 1 else "are"
            settings = ", ".join(f"{key}={format_value(value_at(cfg, key))}" for key in hit)
            lines.append(f"{settings} {verb} set but {reason(cfg)}")
    return lines
