"""The checks a config passes that need what a registered name declared (an estimator's
``requires``, a loss's options, an engine's or a rollout strategy's traits, ...): the layer that
owns the registry knows its entries, so it registers them here, and ``validate_config`` and
``unused_settings`` run every one registered.

- ``register_config_check(name, order=)``: ``fn(cfg)`` raises a one-line ``ConfigError``.
- ``register_unused_rule(name, order=, applies=, keys=, reason=)``: settings ``cfg``'s mode will
  not use (``unused_settings``).
- ``register_run_code(name, order=)``: ``fn(cfg)`` lists the ``key=value`` settings that name
  code to import or run (``run_config.run_code``).

Checks run in ``order`` (then by name), so the first refusal a config meets does not depend on
which module was imported first. ``CHECKS_FROM`` names the modules that register the package's
own checks; they are imported by name when the checks are first asked for (as the schema's
``choices_from`` names its registries), so ``creditrl.config`` imports no registry.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from creditrl.config.schema import Config

__all__ = [
    "CHECKS_FROM",
    "UnusedRule",
    "config_checks",
    "load_checks",
    "register_config_check",
    "register_run_code",
    "register_unused_rule",
    "run_code_finders",
    "unused_rules",
]

CHECKS_FROM = (
    "creditrl.asynchronous.checks",
    "creditrl.core.checks",
    "creditrl.rollout.checks",
    "creditrl.workers.placement",
    "creditrl.agents.checks",
)
"""The modules that register the package's checks (imported by ``load_checks``)."""

ConfigCheck = Callable[["Config"], None]


@dataclass(frozen=True)
class UnusedRule:
    """Settings that ``cfg``'s mode will not use: ``keys`` (a trailing '.' takes a section; or a
    function of the config giving them) when ``applies(cfg)``, because ``reason(cfg)``."""

    applies: Callable[[Config], bool]
    keys: tuple[str, ...] | Callable[[Config], tuple[str, ...]]
    reason: Callable[[Config], str]


_CHECKS: dict[str, tuple[float, ConfigCheck]] = {}
_UNUSED: dict[str, tuple[float, UnusedRule]] = {}
_RUN_CODE: dict[str, tuple[float, Callable[[Config], list[str]]]] = {}


def register_config_check(name: str, *, order: float) -> Callable[[ConfigCheck], ConfigCheck]:
    """Decorator: ``validate_config`` runs ``fn(cfg)`` (which raises a ``ConfigError``) at
    ``order`` among the checks after the choices, options and numbers; a second registration
    of ``name`` replaces the first."""

    def add(fn: ConfigCheck) -> ConfigCheck:
        _CHECKS[name] = (order, fn)
        return fn

    return add


def register_unused_rule(
    name: str,
    *,
    order: float,
    applies: Callable[[Config], bool],
    keys: tuple[str, ...] | Callable[[Config], tuple[str, ...]],
    reason: Callable[[Config], str],
) -> None:
    """``unused_settings`` reports the ``keys`` a user set when ``applies(cfg)``, with
    ``reason(cfg)``, one line at ``order``; a second registration of ``name`` replaces it."""
    _UNUSED[name] = (order, UnusedRule(applies, keys, reason))


def register_run_code(
    name: str, *, order: float
) -> Callable[[Callable[[Config], list[str]]], Callable[[Config], list[str]]]:
    """Decorator: ``run_code`` lists what ``fn(cfg)`` returns (``key=value`` of settings that
    name code to run) at ``order``."""

    def add(fn: Callable[[Config], list[str]]) -> Callable[[Config], list[str]]:
        _RUN_CODE[name] = (order, fn)
        return fn

    return add


def load_checks() -> None:
    """Import the modules in ``CHECKS_FROM`` (once per process), so their checks are known."""
    for module in CHECKS_FROM:
        importlib.import_module(module)


def _ordered(entries: dict[str, tuple[float, Any]]) -> list[Any]:
    load_checks()
    return [entry for _, _, entry in sorted((o, n, e) for n, (o, e) in entries.items())]


def config_checks() -> list[ConfigCheck]:
    """Every registered check, in order."""
    return _ordered(_CHECKS)


def unused_rules() -> list[UnusedRule]:
    """Every registered unused-settings rule, in order."""
    return _ordered(_UNUSED)


def run_code_finders() -> list[Callable[[Config], list[str]]]:
    """Every registered finder of settings that name code, in order."""
    return _ordered(_RUN_CODE)
