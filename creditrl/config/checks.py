"""The checks a config passes that need what a registered name declared (an estimator's
``requires``, a loss's options, an engine's or a rollout strategy's traits, ...): the layer that
owns the registry knows its entries, so it registers them here, and ``validate_config`` and
``unused_settings`` run every one registered.

- ``register_config_check(name)``: ``fn(cfg)`` raises a one-line ``ConfigError``.
- ``register_unused_rule(name, applies=, keys=, reason=)``: settings ``cfg``'s mode will not
  use (``unused_settings``).
- ``register_run_code(name)``: ``fn(cfg)`` lists the ``key=value`` settings that name code to
  import or run (``run_config.run_code``).

Checks run in the order ``CHECK_ORDER`` declares by name, so the first refusal a config meets
does not depend on which module was imported first; a check it does not name (user code) runs
after those, in the order registered. Rules and finders run in the order registered.
``creditrl.catalog`` imports every module that registers the package's own, so
``creditrl.config`` names none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from creditrl.config.schema import Config

__all__ = [
    "CHECK_ORDER",
    "UnusedRule",
    "config_checks",
    "register_config_check",
    "register_run_code",
    "register_unused_rule",
    "run_code_finders",
    "unused_rules",
]

CHECK_ORDER = (
    "endpoint_host",
    "weight_channel",
    "actor_batches",
    "critic_batches",
    "estimator_groups",
    "groups_and_bounds",
    "engine_lora",
    "validation_samples",
    "static_decode_cache",
    "sample_dtype_bf16",
    "data",
    "paths",
    "distill",
)
"""The package's checks by name, in the order they run: batch sizes before the settings that
depend on them, the data and paths (which touch the disk) late, distillation last."""

ConfigCheck = Callable[["Config"], None]


@dataclass(frozen=True)
class UnusedRule:
    """Settings that ``cfg``'s mode will not use: ``keys`` (a trailing '.' takes a section; or a
    function of the config giving them) when ``applies(cfg)``, because ``reason(cfg)``."""

    applies: Callable[[Config], bool]
    keys: tuple[str, ...] | Callable[[Config], tuple[str, ...]]
    reason: Callable[[Config], str]


_CHECKS: dict[str, ConfigCheck] = {}
_UNUSED: dict[str, UnusedRule] = {}
_RUN_CODE: dict[str, Callable[[Config], list[str]]] = {}


def register_config_check(name: str) -> Callable[[ConfigCheck], ConfigCheck]:
    """Decorator: ``validate_config`` runs ``fn(cfg)`` (which raises a ``ConfigError``) among
    the checks after the choices, options and numbers, where ``CHECK_ORDER`` names it (else
    after those); a second registration of ``name`` replaces the first."""

    def add(fn: ConfigCheck) -> ConfigCheck:
        _CHECKS[name] = fn
        return fn

    return add


def register_unused_rule(
    name: str,
    *,
    applies: Callable[[Config], bool],
    keys: tuple[str, ...] | Callable[[Config], tuple[str, ...]],
    reason: Callable[[Config], str],
) -> None:
    """``unused_settings`` reports the ``keys`` a user set when ``applies(cfg)``, with
    ``reason(cfg)``, one line; a second registration of ``name`` replaces it."""
    _UNUSED[name] = UnusedRule(applies, keys, reason)


def register_run_code(
    name: str,
) -> Callable[[Callable[[Config], list[str]]], Callable[[Config], list[str]]]:
    """Decorator: ``run_code`` lists what ``fn(cfg)`` returns (``key=value`` of settings that
    name code to run)."""

    def add(fn: Callable[[Config], list[str]]) -> Callable[[Config], list[str]]:
        _RUN_CODE[name] = fn
        return fn

    return add


def config_checks() -> list[ConfigCheck]:
    """Every registered check, in order (``CHECK_ORDER``, then user checks as registered)."""
    rank = {name: i for i, name in enumerate(CHECK_ORDER)}
    ordered = sorted(_CHECKS, key=lambda name: rank.get(name, len(rank)))
    return [_CHECKS[name] for name in ordered]


def unused_rules() -> list[UnusedRule]:
    """Every registered unused-settings rule, in the order registered."""
    return list(_UNUSED.values())


def run_code_finders() -> list[Callable[[Config], list[str]]]:
    """Every registered finder of settings that name code, in the order registered."""
    return list(_RUN_CODE.values())
