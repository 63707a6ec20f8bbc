"""Rollout strategies: how a batch of prompts becomes trajectories, one registry of entries.

- ``single_turn``: the rollout engine samples one answer per prompt;
- ``agent_loop``: the built-in agent loop (``creditrl.agents.rollout``) around the engine,
  calling creditrl's tools;
- ``agent_program``: the user's ``agent.program`` (``creditrl.agents.program``) through
  creditrl's endpoint;
- ``verifiers``: a verifiers environment's rollouts (``env.verifiers``,
  ``creditrl.environments``) through the same endpoint;
- ``openenv``: an OpenEnv environment's episodes (``env.openenv``,
  ``creditrl.environments.openenv``) through the same endpoint.

The user's keys stay ``agent.enable``, ``agent.program``, ``env.verifiers`` and ``env.openenv``;
``rollout_strategy`` is the one place that reads them to choose an entry. Every other module
asks the chosen entry what it does (``strategy_traits``) or builds it (``build_rollout``). More
entries are added with ``register_rollout_strategy`` and chosen with ``rollout.strategy``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from creditrl.config.checks import register_run_code
from creditrl.config.fields import format_value, value_at
from creditrl.config.schema import Config
from creditrl.core.registry import Registry
from creditrl.errors import ConfigError

__all__ = [
    "ROLLOUT_STRATEGIES",
    "StrategyTraits",
    "build_rollout",
    "register_rollout_strategy",
    "rollout_strategy",
    "strategy_code",
    "strategy_traits",
]

RolloutBuilder = Callable[[Any, Any, Config], Any]
ROLLOUT_STRATEGIES: Registry[RolloutBuilder] = Registry("rollout strategy")


@dataclass(frozen=True)
class StrategyTraits:
    """What a rollout strategy declares about itself.

    - ``multi_turn``: its batches carry the multi-turn fields (messages, tool calls, agent
      info, turn ids) and get the agent metrics; ``agent.state_masking`` and
      ``agent.keep_kv_cache`` (the engine keeps each sample's KV between turns) apply;
    - ``uses_tools``: it runs creditrl's tools (``agent.tools``, ``agent.tool_config``) and
      the built-in loop's settings, scored by ``agent.reward_manager``;
    - ``runs_program``: it runs user code through the endpoint (``agent.program`` or an
      environment's rollout; the endpoint's settings apply);
    - ``needs``: the settings (dotted keys) it cannot run without; choosing it with one unset
      is refused at config load.
    """

    multi_turn: bool = False
    uses_tools: bool = False
    runs_program: bool = False
    needs: tuple[str, ...] = ()


def register_rollout_strategy(
    name: str, traits: StrategyTraits | None = None
) -> Callable[[RolloutBuilder], RolloutBuilder]:
    """Decorator: add ``fn(engine, tokenizer, cfg) -> rollout`` as rollout strategy ``name``,
    declaring what it does (``traits``; default: single-turn batches), chosen with
    ``rollout.strategy=name``. The rollout it builds samples as an engine does
    (``generate(prompts, *, greedy, temperature, seed) -> Batch``) and declares ``last_stats``
    (a ``creditrl.rollout.RolloutEngine`` or ``creditrl.agents.rollout.EngineRollout``)."""
    return ROLLOUT_STRATEGIES.register(name, traits=traits or StrategyTraits())


_register = register_rollout_strategy


@_register("single_turn", StrategyTraits())
def _single_turn(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    """The engine itself samples."""
    return engine


@_register("agent_loop", StrategyTraits(multi_turn=True, uses_tools=True))
def _agent_loop(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    from creditrl.agents.rollout import AgentRollout

    return AgentRollout(engine, tokenizer, cfg.agent, cfg.rollout)


@_register(
    "agent_program", StrategyTraits(multi_turn=True, runs_program=True, needs=("agent.program",))
)
def _agent_program(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    from creditrl.agents.program import ProgramRollout

    return ProgramRollout.for_run(engine, tokenizer, cfg)


@_register(
    "verifiers", StrategyTraits(multi_turn=True, runs_program=True, needs=("env.verifiers",))
)
def _verifiers(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    from creditrl.environments.verifiers import build_verifiers_rollout

    return build_verifiers_rollout(engine, tokenizer, cfg)


@_register("openenv", StrategyTraits(multi_turn=True, runs_program=True, needs=("env.openenv",)))
def _openenv(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    from creditrl.environments.openenv import build_openenv_rollout

    return build_openenv_rollout(engine, tokenizer, cfg)


def rollout_strategy(cfg: Config) -> str:
    """The entry ``cfg`` selects: ``rollout.strategy`` when set (a ConfigError naming the
    choices when nothing is registered under it, or a setting it ``needs`` unset), else
    ``openenv`` when ``env.openenv`` is set, ``verifiers`` when ``env.verifiers`` is set,
    ``agent_program`` when ``agent.program`` is set (with or without ``agent.enable``),
    ``agent_loop`` when ``agent.enable``, else ``single_turn``."""
    chosen = cfg.rollout.strategy
    if chosen is not None:
        if chosen not in ROLLOUT_STRATEGIES:
            raise ConfigError(
                f"rollout.strategy={chosen!r:.80} is not a registered rollout strategy; choose "
                f"one of {', '.join(ROLLOUT_STRATEGIES.names())} (or null)"
            )
        for key in ROLLOUT_STRATEGIES.info(chosen)["traits"].needs:
            if value_at(cfg, key) is None:
                raise ConfigError(
                    f"rollout.strategy={chosen} needs {key}, which is not set; set {key}, or "
                    "leave rollout.strategy null to choose by the agent and env keys"
                )
        return chosen
    if cfg.env.openenv is not None:
        other = "env.verifiers" if cfg.env.verifiers is not None else "agent.program"
        if cfg.env.verifiers is not None or cfg.agent.program is not None:
            raise ConfigError(
                f"env.openenv and {other} both choose the rollout (each runs its own "
                "episodes); set one of them"
            )
        return "openenv"
    if cfg.env.verifiers is not None:
        if cfg.agent.program is not None:
            raise ConfigError(
                "env.verifiers and agent.program both choose the rollout (each runs its own "
                "episodes); set one of them"
            )
        return "verifiers"
    if cfg.agent.program is not None:
        return "agent_program"
    return "agent_loop" if cfg.agent.enable else "single_turn"


def strategy_traits(cfg: Config) -> StrategyTraits:
    """What the strategy ``cfg`` selects declared."""
    return ROLLOUT_STRATEGIES.info(rollout_strategy(cfg))["traits"]


@register_run_code("rollout_strategy", order=10)
def strategy_code(cfg: Config) -> list[str]:
    """``key=value`` of the settings naming the code the selected strategy runs (listed by
    ``creditrl.config.run_config.run_code``, registered with ``creditrl.config.checks``)."""
    found = []
    traits = strategy_traits(cfg)
    if cfg.env.verifiers is not None:
        found.append(f"env.verifiers={format_value(cfg.env.verifiers)}")
    elif cfg.env.openenv is not None:
        found.append(f"env.openenv={format_value(cfg.env.openenv)}")
    elif traits.runs_program:
        found.append(f"agent.program={format_value(cfg.agent.program)}")
    if traits.uses_tools and cfg.agent.tool_config is not None:
        found.append(f"agent.tool_config={format_value(cfg.agent.tool_config)}")
    return found


def build_rollout(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    """What generates the run's batches: the selected strategy built around ``engine``."""
    return ROLLOUT_STRATEGIES.get(rollout_strategy(cfg))(engine, tokenizer, cfg)
