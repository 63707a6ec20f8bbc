"""Settings an extension declares for itself, so a new loss or engine brings its own config keys
from its one file.

A registered entry lists ``Option``s among its ``options`` (``register_policy_loss("mine",
options=(Option("alpha", 0.5, "...", range=UNIT),))``); the user sets them under the section's
``*_kwargs`` key that names the selecting key on its field (``meta(options_for="actor.
policy_loss")``), e.g. ``actor.policy_loss_kwargs.alpha=0.3``. The loader checks each value
against the selected entry's declaration (unknown names, type, choices, range: one-line
``ConfigError``s) and fills in the declared defaults, so the entry always reads every option it
declared. ``creditrl config --doc`` lists the options of every registered entry.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from creditrl.config.fields import Range, format_value, value_at
from creditrl.errors import ConfigError
from creditrl.registry import registry

__all__ = ["DeclaredKey", "Option", "declared_keys", "resolve_options"]

_TYPES: dict[type, str] = {bool: "a bool", int: "an int", float: "a number", str: "a string"}


@dataclass(frozen=True)
class Option:
    """One setting an extension reads: its ``name`` (a key under the section's ``*_kwargs``),
    ``default`` (its type is the option's type: bool, int, float or str), ``doc``, and what it
    accepts (``range`` for numbers, ``choices`` for strings)."""

    name: str
    default: bool | int | float | str
    doc: str = ""
    range: Range | None = None
    choices: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"Option name {self.name!r} is not an identifier")
        if type(self.default) not in _TYPES:
            raise TypeError(
                f"Option {self.name!r}: default {self.default!r} is not a bool, int, float or str"
            )
        self.check(self.default, f"Option {self.name!r} default")

    @property
    def type_name(self) -> str:
        return type(self.default).__name__

    def allowed(self) -> str:
        """What the option accepts, as the docs write it ('' when any value of its type)."""
        if self.choices is not None:
            return "one of " + ", ".join(self.choices)
        return self.range.text() if self.range is not None else ""

    def check(self, value: Any, key: str) -> Any:
        """``value`` as the option's type; ConfigError naming ``key`` if it is not allowed."""
        kind = type(self.default)
        ok = type(value) is kind or (kind is float and type(value) is int)
        if not ok:
            raise ConfigError(f"{key}={_shown(value)} is not {_TYPES[kind]}")
        value = float(value) if kind is float else value
        if kind is float and not math.isfinite(value):
            raise ConfigError(f"{key}={format_value(value)} is not a finite number")
        if self.choices is not None and value not in self.choices:
            raise ConfigError(f"{key}={_shown(value)} is not {self.allowed()}")
        if self.range is not None and kind is not bool and not self.range.holds(value):
            raise ConfigError(f"{key}={format_value(value)} must be {self.range.text()}")
        return value


def _shown(value: Any) -> str:
    text = format_value(value)
    return text if len(text) <= 80 else f"{text[:80]}... ({len(text)} chars)"


def _registry(selector_meta: Mapping[str, Any]) -> Any:
    return registry(selector_meta["registry"])


def _declared(entries: Any, name: str) -> tuple[Option, ...]:
    return tuple(o for o in entries.info(name).get("options", ()) if isinstance(o, Option))


@dataclass(frozen=True)
class DeclaredKey:
    """An option as ``config --doc`` lists it: its dotted key and the entry declaring it."""

    key: str
    owner: str
    option: Option


def _kwargs_fields(cfg: Any, prefix: str = "") -> Iterator[tuple[str, str, Any]]:
    """(dotted ``*_kwargs`` key, the key selecting its entry, the section holding it)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _kwargs_fields(value, f"{prefix}{f.name}.")
        elif "options_for" in f.metadata:
            yield f"{prefix}{f.name}", f.metadata["options_for"], cfg


def _selector_meta(root: Any, selector: str) -> Mapping[str, Any]:
    section, _, leaf = selector.rpartition(".")
    node = value_at(root, section) if section else root
    return next(f.metadata for f in dataclasses.fields(node) if f.name == leaf)


def declared_keys(root: Any, key: str, selector: str) -> list[DeclaredKey]:
    """The options under ``key`` (a ``*_kwargs`` mapping of ``root``) that every entry
    registered for ``selector`` declares, in registration order."""
    entries = _registry(_selector_meta(root, selector))
    return [
        DeclaredKey(f"{key}.{option.name}", f"{selector}={name}", option)
        for name in entries.first_names()
        for option in _declared(entries, name)
    ]


def resolve_options(cfg: Any) -> None:
    """Check every ``*_kwargs`` section of ``cfg`` against the options its selected entry
    declares and fill in their defaults (in place); one-line ConfigError on an undeclared
    name or a bad value. An entry not registered is left alone (its name is refused first)."""
    for key, selector, section in _kwargs_fields(cfg):
        entries = _registry(_selector_meta(cfg, selector))
        name = value_at(cfg, selector)
        if name not in entries:
            continue
        declared = {option.name: option for option in _declared(entries, name)}
        given = getattr(section, key.rsplit(".", 1)[-1])
        for option_name in given:
            if option_name not in declared:
                offered = ", ".join(declared) or "none"
                raise ConfigError(
                    f"{key}.{option_name}: not an option of {selector}={name} (it declares "
                    f"{offered})"
                )
        values = {
            n: option.check(given[n], f"{key}.{n}") if n in given else option.default
            for n, option in declared.items()
        }
        setattr(section, key.rsplit(".", 1)[-1], values)
