"""Checks on a loaded Config, the one place a config is refused: each choice-valued key against
its choices, each number against its range, and combinations that cannot train (one-line
``ConfigError``s); settings the user gave that the chosen mode will not use (warnings).

``load_config`` runs them; a Config built directly in code is not checked. A key's choices and
range live on its field in ``schema.py`` (``creditrl.config.fields``); registry-backed choices
are read from the registries named there when checked, so a user-registered estimator or loss
is accepted. Rules that relate several keys live here; those that need what a registered name
declared live with its registry, which registers them (``creditrl.config.checks``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Any

from creditrl.config.checks import (
    UnusedRule,
    config_checks,
    register_config_check,
    register_unused_rule,
    unused_rules,
)
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
    "check_batches",
    "format_value",
    "import_extensions",
    "schema_fields",
    "unused_settings",
    "validate_config",
]


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


def check_batches(cfg: Config, section: str) -> None:
    """``section``'s mini-batch against the batch and the workers (``actor`` here; ``critic``
    where the estimator builds one, ``creditrl.core.checks``)."""
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


# The order of every registered check is creditrl.config.checks.CHECK_ORDER.


@register_config_check("actor_batches")
def _check_actor_batches(cfg: Config) -> None:
    check_batches(cfg, "actor")


@register_config_check("groups_and_bounds")
def _check_groups_and_bounds(cfg: Config) -> None:
    alg, n = cfg.algorithm, cfg.rollout.n
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


@register_config_check("validation_samples")
def _check_validation_samples(cfg: Config) -> None:
    if cfg.rollout.val_n > 1 and cfg.rollout.val_temperature == 0:
        raise ConfigError(
            f"rollout.val_n={cfg.rollout.val_n} with rollout.val_temperature=0 validates with "
            f"{cfg.rollout.val_n} identical greedy answers (pass@k would equal mean@1); set "
            "rollout.val_temperature > 0 or rollout.val_n=1"
        )


@register_config_check("data")
def _check_data(cfg: Config) -> None:
    if not cfg.data.task and not cfg.data.train_files:
        raise ConfigError("no data: set data.task (a reasoning-gym name) or data.train_files")


@register_config_check("paths")
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


def import_extensions(cfg: Config) -> None:
    """Import ``trainer.extensions`` (once per process), so what they register is known."""
    for target in cfg.trainer.extensions:
        load_user_module(target, "trainer.extensions")


def validate_config(cfg: Config, *, import_code: bool = True) -> None:
    """Raise a one-line ConfigError for the first setting ``cfg`` cannot train with, after
    importing ``trainer.extensions`` (unless ``import_code`` is false: a run's config read as
    data); fills in the options extensions declare (``creditrl.config.options``). After the
    choices, options and numbers, every check registered with ``creditrl.config.checks`` runs
    in its order (those here, and those of the registries)."""
    if import_code:
        import_extensions(cfg)
    _check_choices(cfg)
    resolve_options(cfg)
    _check_numbers(cfg)
    for check in config_checks():
        check(cfg)


# (condition under which the keys are unused, keys (a trailing '.' takes a section), reason);
# the rules that need a registry's declarations are registered by it (creditrl.core.checks at
# 0, 110, 170-240; creditrl.rollout.checks at 10-40 and 140)
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
UNUSED_RULES: dict[str, UnusedRule] = {
    "kl_in_reward": UnusedRule(
        lambda c: not c.algorithm.use_kl_in_reward,
        ("algorithm.kl_ctrl.", "algorithm.kl_penalty"),
        lambda c: "algorithm.use_kl_in_reward=false",
    ),
    "kl_loss": UnusedRule(
        lambda c: not c.actor.use_kl_loss,
        ("actor.kl_loss_type", "actor.kl_loss_coef"),
        lambda c: "actor.use_kl_loss=false",
    ),
    **{
        section: UnusedRule(
            lambda c, s=section: not value_at(c, f"algorithm.{s}.enable"),
            (f"algorithm.{section}.",),
            lambda c, s=section: f"algorithm.{s}.enable=false",
        )
        for section in ("rollout_is", "filter_groups", "overlong_buffer")
    },
    "distill": UnusedRule(
        lambda c: c.distill.teacher is None,
        ("distill.",),
        lambda c: "distill.teacher is not set (no distillation)",
    ),
    "teacher_prompt": UnusedRule(
        lambda c: c.distill.teacher_prompt != "few_shot",
        ("distill.teacher_few_shot",),
        lambda c: f"distill.teacher_prompt={c.distill.teacher_prompt}",
    ),
    "reward_model": UnusedRule(
        lambda c: not c.reward.reward_model.enable,
        ("reward.reward_model.",),
        lambda c: "reward.reward_model.enable=false",
    ),
    "local_backend": UnusedRule(
        lambda c: c.trainer.backend == "local" and c.asynchronous.launcher != "ray",
        ("trainer.ray.", "trainer.critic_placement"),
        lambda c: "trainer.backend=local",
    ),
    "lora": UnusedRule(
        lambda c: c.model.lora_rank == 0,
        ("model.lora_alpha", "model.target_modules", "asynchronous.lora_sync"),
        lambda c: "model.lora_rank=0 (no LoRA)",
    ),
    "async_reward": UnusedRule(
        lambda c: c.algorithm.filter_groups.enable,
        ("reward.async_reward",),
        lambda c: (
            "algorithm.filter_groups.enable=true scores each generation batch before "
            "choosing groups, so scoring cannot overlap the log-prob pass"
        ),
    ),
    **{
        f"{section}_dynamic_bsz": UnusedRule(
            lambda c, s=section: value_at(c, f"{s}.use_dynamic_bsz") is False,
            (f"{section}.max_token_len_per_device",),
            lambda c, s=section: f"{s}.use_dynamic_bsz=false",
        )
        for section in ("actor", "critic")
    },
    **{
        f"{section}_lr_scheduler": UnusedRule(
            lambda c, s=section: value_at(c, f"{s}.optim.lr_scheduler") == "constant",
            (f"{section}.optim.min_lr_ratio",),
            lambda c, s=section: f"{s}.optim.lr_scheduler=constant",
        )
        for section in ("actor", "critic")
    },
}
"""The unused-settings rules config judges alone: {name: rule}, registered below."""
for _name, _rule in UNUSED_RULES.items():
    register_unused_rule(_name, applies=_rule.applies, keys=_rule.keys, reason=_rule.reason)


def unused_settings(cfg: Config, explicit: Collection[str]) -> list[str]:
    """One line per rule: the keys in ``explicit`` (given by the user) that ``cfg``'s mode will
    not use, with their values and why, e.g. "critic.optim.lr=1e-05 is set but
    algorithm.adv_estimator=grpo uses no critic"."""
    lines = []
    for applies, rule_keys, reason in (
        (rule.applies, rule.keys, rule.reason) for rule in unused_rules()
    ):
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
