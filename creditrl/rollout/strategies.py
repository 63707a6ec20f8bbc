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
from creditrl.errors import ConfigError
from creditrl.registry import Registry, import_path

__all__ = [
    "ROLLOUT_STRATEGIES",
    "StrategyTraits",
    "build_rollout",
    "register_rollout_strategy",
    "rollout_strategy",
    "strategy_code",
    "strategy_datasets",
    "strategy_preflight",
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
      is refused at config load;
    - ``datasets``: its own prompts, ``fn(cfg, tokenizer) -> (train, val)`` datasets (or a
      ``"creditrl.module:fn"`` path, imported when asked); None: the data section's prompts
      (or an agent task's);
    - ``preflight``: ``fn(cfg)`` checking what it will load before any model is built (or a
      path); raises a one-line error;
    - ``selected_by``: the setting (a dotted key) that chooses it when ``rollout.strategy`` is
      null: the first entry, in registration order, whose key is set (not null, not false) is
      chosen; two set that both ``runs_program`` are refused (each runs its own episodes). It
      is also needed, and with ``runs_program`` it names the code the strategy runs.
    """

    multi_turn: bool = False
    uses_tools: bool = False
    runs_program: bool = False
    needs: tuple[str, ...] = ()
    selected_by: str | None = None
    datasets: str | Callable[[Config, Any], tuple[Any, Any]] | None = None
    preflight: str | Callable[[Config], None] | None = None

    def needed(self) -> tuple[str, ...]:
        """``needs`` with ``selected_by`` when that names code to run."""
        extra = (self.selected_by,) if self.runs_program and self.selected_by else ()
        return tuple(dict.fromkeys((*self.needs, *extra)))


def register_rollout_strategy(
    name: str, traits: StrategyTraits | None = None
) -> Callable[[RolloutBuilder], RolloutBuilder]:
    """Decorator: add ``fn(engine, tokenizer, cfg) -> rollout`` as rollout strategy ``name``,
    declaring what it does (``traits``; default: single-turn batches; ``traits.datasets``
    brings its own prompts), chosen with ``rollout.strategy=name`` or by its ``selected_by``
    key. The rollout it builds samples as an engine does (``generate(prompts, *, greedy,
    temperature, seed) -> Batch``) and declares ``last_stats`` (a
    ``creditrl.rollout.RolloutEngine`` or ``creditrl.agents.rollout.EngineRollout``)."""
    return ROLLOUT_STRATEGIES.register(name, traits=traits or StrategyTraits())


def single_turn(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    """The ``single_turn`` strategy: the engine itself samples."""
    return engine


def _add(name: str, path: str, traits: StrategyTraits) -> None:
    ROLLOUT_STRATEGIES.add(name, path, traits=traits)


# In the order they are chosen when rollout.strategy is null (rollout_strategy).
def _hub(name: str, module: str, selected_by: str) -> None:
    """An environment hub's entry: its module's ``build_<name>_rollout``,
    ``environment_datasets`` (the hub's prompts) and ``check_environment`` (its preflight)."""
    traits = StrategyTraits(
        multi_turn=True,
        runs_program=True,
        selected_by=selected_by,
        datasets=f"{module}:environment_datasets",
        preflight=f"{module}:check_environment",
    )
    _add(name, f"{module}:build_{name}_rollout", traits)


_hub("openenv", "creditrl.environments.openenv", "env.openenv")
_hub("verifiers", "creditrl.environments.verifiers", "env.verifiers")
_add(
    "agent_program",
    "creditrl.agents.program:program_rollout",
    StrategyTraits(multi_turn=True, runs_program=True, selected_by="agent.program"),
)
_add(
    "agent_loop",
    "creditrl.agents.rollout:agent_loop_rollout",
    StrategyTraits(multi_turn=True, uses_tools=True, selected_by="agent.enable"),
)
_add("single_turn", "creditrl.rollout.strategies:single_turn", StrategyTraits())


def rollout_strategy(cfg: Config) -> str:
    """The entry ``cfg`` selects: ``rollout.strategy`` when set (a ConfigError naming the
    choices when nothing is registered under it, or a setting it ``needs`` unset), else the
    first entry whose ``selected_by`` key is set (``openenv`` for ``env.openenv``,
    ``verifiers`` for ``env.verifiers``, ``agent_program`` for ``agent.program``, with or
    without ``agent.enable``, ``agent_loop`` for ``agent.enable``), else ``single_turn``."""
    chosen = cfg.rollout.strategy
    if chosen is not None:
        if chosen not in ROLLOUT_STRATEGIES:
            raise ConfigError(
                f"rollout.strategy={chosen!r:.80} is not a registered rollout strategy; choose "
                f"one of {', '.join(ROLLOUT_STRATEGIES.names())} (or null)"
            )
        for key in ROLLOUT_STRATEGIES.info(chosen)["traits"].needed():
            if value_at(cfg, key) is None:
                raise ConfigError(
                    f"rollout.strategy={chosen} needs {key}, which is not set; set {key}, or "
                    "leave rollout.strategy null to choose by the agent and env keys"
                )
        return chosen
    selected = [
        (name, traits)
        for name in ROLLOUT_STRATEGIES
        if (traits := ROLLOUT_STRATEGIES.info(name)["traits"]).selected_by
        and value_at(cfg, traits.selected_by) not in (None, False)
    ]
    if not selected:
        return "single_turn"
    (name, first), *others = selected
    clash = [t.selected_by for _, t in others if first.runs_program and t.runs_program]
    if clash:
        raise ConfigError(
            f"{first.selected_by} and {clash[0]} both choose the rollout (each runs its own "
            "episodes); set one of them"
        )
    return name


def strategy_traits(cfg: Config) -> StrategyTraits:
    """What the strategy ``cfg`` selects declared."""
    return ROLLOUT_STRATEGIES.info(rollout_strategy(cfg))["traits"]


@register_run_code("rollout_strategy")
def strategy_code(cfg: Config) -> list[str]:
    """``key=value`` of the settings naming the code the selected strategy runs (listed by
    ``creditrl.config.run_config.run_code``, registered with ``creditrl.config.checks``)."""
    found = []
    traits = strategy_traits(cfg)
    for key in traits.needed():
        found.append(f"{key}={format_value(value_at(cfg, key))}")
    if traits.uses_tools and cfg.agent.tool_config is not None:
        found.append(f"agent.tool_config={format_value(cfg.agent.tool_config)}")
    return found


def _hook(hook: str | Callable[..., Any]) -> Callable[..., Any]:
    return import_path(hook) if isinstance(hook, str) else hook


def strategy_datasets(cfg: Config, tokenizer: Any) -> tuple[Any, Any] | None:
    """The (train, validation) datasets the selected strategy brings (``datasets``), or None
    when it samples the data section's prompts."""
    hook = strategy_traits(cfg).datasets
    return None if hook is None else _hook(hook)(cfg, tokenizer)


def strategy_preflight(cfg: Config) -> None:
    """Run the selected strategy's ``preflight`` (what it will load, checked before any model
    is built), if it declares one."""
    hook = strategy_traits(cfg).preflight
    if hook is not None:
        _hook(hook)(cfg)


def build_rollout(engine: Any, tokenizer: Any, cfg: Config) -> Any:
    """What generates the run's batches: the selected strategy built around ``engine``."""
    return ROLLOUT_STRATEGIES.get(rollout_strategy(cfg))(engine, tokenizer, cfg)
