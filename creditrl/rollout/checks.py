"""The config checks that need what ``creditrl.rollout``'s registries declared (an engine's
traits and options, the selected rollout strategy's traits), registered with
``creditrl.config.checks``: the registry knows its entries, ``creditrl.config`` only names the
settings. (The settings naming the code a strategy runs are listed by
``creditrl.rollout.strategies``, the one reader of the agent and env keys.)"""

from __future__ import annotations

from creditrl.config.checks import register_config_check, register_unused_rule
from creditrl.config.schema import Config
from creditrl.config.validate import BUILT_IN_LOOP_KEYS, PROGRAM_KEYS
from creditrl.errors import ConfigError
from creditrl.rollout.registries import ROLLOUT_ENGINES, EngineTraits, engine_traits
from creditrl.rollout.strategies import strategy_traits

__all__ = ["configured_engine_traits", "other_engines_options"]


def configured_engine_traits(cfg: Config) -> EngineTraits:
    """What the configured engine declared (``register_rollout_engine``); the defaults for a
    name not registered (refused elsewhere)."""
    name = cfg.rollout.engine
    return engine_traits(name) if name in ROLLOUT_ENGINES else EngineTraits()


def other_engines_options(cfg: Config) -> tuple[str, ...]:
    """The ``rollout.*`` keys that registered engines declare as their options and the
    configured engine does not."""
    ours = set(configured_engine_traits(cfg).options)
    declared = {
        key
        for name in ROLLOUT_ENGINES
        for key in engine_traits(name).options
        if isinstance(key, str)  # an Option of its own lives under rollout.engine_kwargs
    }
    return tuple(f"rollout.{key}" for key in sorted(declared - ours))


@register_config_check("engine_lora")
def _check_engine_lora(cfg: Config) -> None:
    if cfg.model.lora_rank > 0 and not configured_engine_traits(cfg).supports_lora:
        raise ConfigError(
            f"rollout.engine={cfg.rollout.engine} with model.lora_rank > 0 is not supported yet"
        )


@register_config_check("static_decode_cache")
def _check_static_decode_cache(cfg: Config) -> None:
    static = cfg.rollout.engine_kwargs.get("decode_cache")
    if static == "static" and strategy_traits(cfg).multi_turn and cfg.agent.keep_kv_cache:
        raise ConfigError(
            "rollout.engine_kwargs.decode_cache=static decodes from a preallocated KV cache, "
            "which cannot keep a turn's KV for the next (agent.keep_kv_cache=true); set "
            "agent.keep_kv_cache=false or decode_cache=auto"
        )


register_unused_rule(
    "agent",
    applies=lambda c: not strategy_traits(c).multi_turn,
    keys=("agent.",),
    reason=lambda c: "agent.enable=false",
)
register_unused_rule(
    "program_keys",
    applies=lambda c: strategy_traits(c).multi_turn and not strategy_traits(c).runs_program,
    keys=PROGRAM_KEYS,
    reason=lambda c: "agent.program is not set (these are its settings)",
)
register_unused_rule(
    "built_in_loop_keys",
    applies=lambda c: strategy_traits(c).multi_turn and not strategy_traits(c).uses_tools,
    keys=BUILT_IN_LOOP_KEYS,
    reason=lambda c: "agent.program runs its own loop and tools (these are the built-in loop's)",
)
register_unused_rule(
    "few_shot",
    applies=lambda c: bool(c.data.train_files) or strategy_traits(c).multi_turn,
    keys=("data.few_shot",),
    reason=lambda c: (
        "data.train_files holds the prompts"
        if c.data.train_files
        else "agent tasks show their own example (data.task_kwargs.few_shot)"
    ),
)
register_unused_rule(
    "other_engines_options",
    applies=lambda c: True,
    keys=other_engines_options,
    reason=lambda c: f"rollout.engine={c.rollout.engine} (these settings are other engines')",
)
