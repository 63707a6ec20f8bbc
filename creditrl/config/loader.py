"""Build a Config from defaults, a preset, a YAML file and ``a.b=c`` overrides (in that order),
then check it (``validate.py``).

Every mistake is a one-line ConfigError naming the file or override and the key: a malformed
override, a YAML syntax error (with its line), a file that is not a mapping, an unknown key
(verl's and TRL's names are answered with creditrl's, others with the nearest key), a section
given a value, a value of the wrong type. One value given to a list key
(``data.train_files=a.jsonl``) is a one-item list.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import (
    ConfigAttributeError,
    ConfigKeyError,
    OmegaConfBaseException,
    ValidationError,
)

from creditrl.config.fields import value_at
from creditrl.config.limits import MAX_CONFIG_BYTES, check_override, check_yaml, shorten
from creditrl.config.schema import Config
from creditrl.config.trl_names import trl_hint
from creditrl.config.validate import (
    format_value,
    import_extensions,
    unused_settings,
    validate_config,
)
from creditrl.config.verl_names import creditrl_name
from creditrl.errors import ConfigError

__all__ = [
    "MODES",
    "PRESETS",
    "ConfigError",
    "LoadedConfig",
    "all_keys",
    "async_default_notes",
    "load_config",
    "load_config_with_sources",
    "to_dict",
]

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
MODES = ("sync", "async")
# Defaults of the async commands, under the preset: spec 003's losses average each sequence's
# token terms over its length, then over the batch.
ASYNC_DEFAULTS: dict[str, Any] = {"actor": {"loss_agg_mode": "seq-mean-token-mean"}}
KEY = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
TYPE_NAMES = {float: "a float", int: "an integer", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class LoadedConfig:
    """A checked Config, the dotted keys the user set (preset, file, overrides), and one line per
    group of those settings the chosen mode will not use."""

    config: Config
    explicit: frozenset[str]
    warnings: list[str]


@functools.cache
def _schema() -> dict[str, Any]:
    """Dotted key -> type hint of every field; a section's hint is its dataclass."""
    out: dict[str, Any] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            out[prefix + f.name] = hints[f.name]
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")

    walk(Config, "")
    return out


def all_keys() -> list[str]:
    """Every dotted key of the schema (leaves and sections)."""
    return list(_schema())


def _unwrap(hint: Any) -> Any:
    """``X | None`` -> X."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def _describe(key: str) -> str:
    """What ``key`` (``a.b`` or a list item ``a.b[0]``) accepts, e.g. 'a float or null'."""
    base, _, index = key.partition("[")
    hint = _schema().get(base, Any)
    optional = _unwrap(hint) is not hint and not index
    hint = _unwrap(hint)
    origin = typing.get_origin(hint)
    if index and origin is list:
        hint, origin = typing.get_args(hint)[0], None
    text = {list: "a list", dict: "a mapping"}.get(origin) or TYPE_NAMES.get(hint, "valid")
    return f"{text} or null" if optional else text


def _suggest(key: str) -> str:
    """'; did you mean ...?' for the nearest schema key, or ''.

    A key whose last part exists elsewhere (``actor.lr`` -> ``actor.optim.lr``) is preferred,
    within the same section first; otherwise the closest spelling of the whole key.
    """
    keys = all_keys()
    section, leaf = key.split(".", 1)[0], key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key]
    same_leaf.sort(key=lambda k: k.split(".", 1)[0] != section)
    close = same_leaf[:1] or difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else ""


def _unknown_key(key: str, source: str) -> ConfigError:
    """The error for the unknown key ``key``: creditrl's name for a verl or TRL name (or, for
    a TRL name without an exact equivalent, what differs), else the nearest key."""
    ours = creditrl_name(key, _schema())
    if ours is not None:
        return ConfigError(
            f"unknown key '{key}' (verl's name, from {source}); creditrl calls it '{ours}'"
        )
    hint = trl_hint(key)
    if hint is not None:
        return ConfigError(f"unknown key '{key}' (TRL's name, from {source}); {hint}")
    return ConfigError(f"unknown key '{key}' (from {source}){_suggest(key)}")


def _unknown(key: str, value: Any, source: str) -> ConfigError:
    """The error for an unknown key, named down to its first leaf (``a.b.c`` for ``a: {b: {c:
    1}}``)."""
    while isinstance(value, dict) and value:
        first = next(iter(value))
        key, value = f"{key}.{first}", value[first]
    return _unknown_key(key, source)


def _normalise(tree: dict, source: str, explicit: set[str], prefix: str = "") -> dict[str, Any]:
    """``tree`` checked against the schema (keys, sections), one value for a list key made a
    one-item list; adds each dotted key set to ``explicit``."""
    schema = _schema()
    out: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        hint = schema.get(key) if isinstance(name, str) else None
        if hint is None:
            raise _unknown(key, value, source)
        if dataclasses.is_dataclass(hint):
            if value is None:
                continue
            if not isinstance(value, dict):
                children = [f.name for f in dataclasses.fields(hint)]
                example = "enable" if "enable" in children else children[0]
                raise ConfigError(
                    f"'{key}' is a section, not a value (from {source}); set its keys, e.g. "
                    f"{key}.{example}=..."
                )
            out[name] = _normalise(value, source, explicit, f"{key}.")
            continue
        origin = typing.get_origin(_unwrap(hint))
        if isinstance(value, dict) and origin is not dict:
            raise ConfigError(
                f"'{key}' is a setting, not a section (from {source}); give it {_describe(key)}"
            )
        if origin is list and value is not None and not isinstance(value, list):
            value = [value]
        explicit.add(key)
        out[name] = value
    return out


def _lookup(tree: Any, key: str) -> Any:
    """The value at ``a.b`` or ``a.b[0]`` of a nested dict (None when absent)."""
    base, _, index = key.partition("[")
    for part in base.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    if index and isinstance(tree, list):
        position = int(index.rstrip("]"))
        tree = tree[position] if position < len(tree) else None
    return tree


def _merge(base: DictConfig, tree: dict[str, Any], source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, tree)
    except (ConfigKeyError, ConfigAttributeError) as err:
        key = str(getattr(err, "full_key", "") or err.key)
        raise _unknown_key(key, source) from None
    except ValidationError as err:
        key = str(getattr(err, "full_key", "") or "")
        value = shorten(format_value(_lookup(tree, key)))
        raise ConfigError(f"{key}: {value} is not {_describe(key)} (from {source})") from None


def _yaml_error(path: Path, err: yaml.YAMLError) -> ConfigError:
    mark = getattr(err, "problem_mark", None)
    where = f"{path}, line {mark.line + 1}" if mark is not None else str(path)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return ConfigError(f"{where}: YAML syntax error: {problem}")


def _read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file as a plain dict; one-line errors for its size (``creditrl.config.limits``),
    syntax and a top level that is not a mapping."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: {size} bytes, above the limit of {MAX_CONFIG_BYTES}")
        text = path.read_text(encoding="utf-8")
        check_yaml(text, str(path))
        top = yaml.safe_load(text)
        if top is not None and not isinstance(top, dict):
            found = "a list" if isinstance(top, list) else f"the value {top!r}"
            raise ConfigError(
                f"{path} is not a mapping of config keys (its top level is {found}); write "
                "e.g. 'rollout:' and below it '  n: 8'"
            )
        return OmegaConf.to_container(OmegaConf.create(text))
    except yaml.YAMLError as err:
        raise _yaml_error(path, err) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None


def _mapping_field(key: str) -> bool:
    """``key`` names a free-form mapping field (``data.task_kwargs``, ``rollout.engine_kwargs``,
    ...): an override that sets it whole replaces its value (another task's arguments must not
    inherit chain_sum's), while ``key.name=value`` still sets one entry."""
    return typing.get_origin(_unwrap(_schema().get(key, Any))) is dict


def _parse_override(item: str) -> dict[str, Any]:
    """``a.b=value`` as ``{"a": {"b": value}}``, the value read as YAML (within
    ``creditrl.config.limits``)."""
    if "=" not in item:
        raise ConfigError(f"override '{shorten(item)}' is not of the form key=value")
    check_override(item)
    key, text = item.split("=", 1)
    if not KEY.match(key):
        raise ConfigError(
            f"override '{shorten(item)}': '{shorten(key)}' is not a dotted key such as "
            "actor.optim.lr"
        )
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={text}"]))
    except (yaml.YAMLError, OmegaConfBaseException, ValueError) as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(
            f"override '{shorten(item)}': cannot read the value {shorten(text)!r} ({problem})"
        ) from None


def load_config_with_sources(
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    preset: str | None = None,
    mode: str = "sync",
    *,
    import_code: bool = True,
) -> LoadedConfig:
    """Defaults <- mode defaults <- preset <- YAML file <- overrides, checked; with the keys
    the user set and warnings for those the chosen mode will not use. ``import_code=False``
    checks without importing ``trainer.extensions`` (``creditrl.config.run_config``).

    A YAML file may name its own preset with a top-level ``preset: name`` key; the ``preset``
    argument (or an override ``preset=name``) wins over it. ``mode="async"`` starts from
    ``ASYNC_DEFAULTS`` (what ``creditrl async``/``learner``/``sampler`` train with).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    file_tree: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        file_tree = _read_yaml(path)
    override_trees = []
    replaced: dict[str, str] = {}  # mapping fields an override sets whole -> that override
    for item in overrides or []:
        tree = _parse_override(item)
        key = item.split("=", 1)[0]
        if "preset" in tree:
            preset = str(tree["preset"])
        else:
            override_trees.append((tree, f"override '{shorten(item)}'"))
            if _mapping_field(key):
                replaced[key] = override_trees[-1][1]
    file_preset = file_tree.pop("preset", None)
    preset = preset or file_preset
    layers: list[tuple[dict[str, Any], str, bool]] = []
    if mode == "async":
        layers.append((ASYNC_DEFAULTS, "the async defaults", False))
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset '{preset}'; choose one of {', '.join(PRESETS)}")
        layers.append((_read_yaml(PRESET_DIR / f"{preset}.yaml"), f"preset {preset}", True))
    if file_tree:
        layers.append((file_tree, str(config_file), True))
    layers.extend((tree, source, True) for tree, source in override_trees)
    cfg = OmegaConf.structured(Config)
    explicit: set[str] = set()
    for tree, source, from_user in layers:
        for key in [k for k, by in replaced.items() if by == source]:
            OmegaConf.update(cfg, key, {}, merge=False)
        keys: set[str] = set()
        cfg = _merge(cfg, _normalise(tree, source, keys), source)
        if from_user:
            explicit |= keys
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as err:
        raise ConfigError(f"cannot resolve the config: {str(err).splitlines()[0]}") from None
    validate_config(config, import_code=import_code)
    return LoadedConfig(config, frozenset(explicit), unused_settings(config, explicit))


def load_config(
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    preset: str | None = None,
    mode: str = "sync",
) -> Config:
    """Defaults <- preset <- YAML file <- overrides; a checked, typed Config (see
    ``load_config_with_sources``)."""
    return load_config_with_sources(config_file, overrides, preset, mode).config


def async_default_notes(loaded: LoadedConfig) -> list[str]:
    """One line per ``ASYNC_DEFAULTS`` setting that no preset, file or override set, so the
    async default decided it and ``creditrl train`` would use another value: what each uses and
    how to choose (``creditrl async`` and ``creditrl learner`` print it at start-up)."""
    notes = []
    for section, values in ASYNC_DEFAULTS.items():
        for name, value in values.items():
            key = f"{section}.{name}"
            sync = value_at(Config(), key)
            chosen = value_at(loaded.config, key)
            if key not in loaded.explicit and chosen == value and sync != value:
                notes.append(
                    f"{key}={value}: the async default (spec 003), which no preset, file or "
                    f"override set; creditrl train uses {key}={sync}; set {key} to choose"
                )
    return notes


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain JSON-safe dicts (for checkpoints, logs and printing)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def from_dict(data: dict[str, Any]) -> Config:
    """Inverse of ``to_dict`` (how a config travels to a worker process, as JSON); imports its
    ``trainer.extensions`` so the worker knows what they register."""
    cfg = OmegaConf.to_object(_merge(OmegaConf.structured(Config), data, "a config dict"))
    import_extensions(cfg)
    return cfg


def save_resolved_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically), so tools can read a run's settings."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(OmegaConf.to_yaml(to_dict(cfg)))
    tmp.replace(path)
