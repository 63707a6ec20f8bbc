"""Build a Config from defaults, a preset, a YAML file and ``a.b=c`` overrides (in that order).

Unknown keys are errors that suggest the nearest valid key. Types are checked by omegaconf
against the dataclasses in ``schema.py``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from creditrl.config.schema import Config
from creditrl.errors import ConfigError

__all__ = ["PRESETS", "ConfigError", "all_keys", "load_config", "to_dict"]

PRESET_DIR = Path(__file__).parent / "presets"
PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def all_keys(node: Any = None, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (leaves and sections)."""
    node = OmegaConf.structured(Config) if node is None else node
    keys = []
    for key, value in node.items_ex(resolve=False) if isinstance(node, DictConfig) else []:
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        if isinstance(value, DictConfig) and OmegaConf.get_type(value) is not dict:
            keys.extend(all_keys(value, dotted + "."))
    return keys


def _suggest(key: str) -> str:
    """' Did you mean ...?' for the nearest schema key, or ''.

    A key whose last part exists elsewhere (``actor.lr`` -> ``actor.optim.lr``) is preferred,
    within the same section first; otherwise the closest spelling of the whole key.
    """
    keys = all_keys()
    section, leaf = key.split(".", 1)[0], key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k != key]
    same_leaf.sort(key=lambda k: k.split(".", 1)[0] != section)
    close = same_leaf[:1] or difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    return f" Did you mean '{close[0]}'?" if close else ""


def _merge(base: DictConfig, other: DictConfig | dict, source: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, other)
    except (ConfigKeyError, ConfigAttributeError) as err:
        key = str(getattr(err, "full_key", "") or err.key)
        raise ConfigError(f"unknown config key '{key}' (from {source}).{_suggest(key)}") from None
    except ValidationError as err:
        key = str(getattr(err, "full_key", "") or "")
        msg = str(err.msg).splitlines()[0]
        raise ConfigError(f"bad value for '{key}' (from {source}): {msg}") from None


def load_config(
    config_file: str | Path | None = None,
    overrides: list[str] | None = None,
    preset: str | None = None,
) -> Config:
    """Defaults <- preset <- YAML file <- overrides; returns a typed Config object.

    A YAML file may name its own preset with a top-level ``preset: name`` key; the ``preset``
    argument (or an override ``preset=name``) wins over it.
    """
    cfg = OmegaConf.structured(Config)
    file_cfg: dict[str, Any] = {}
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        file_cfg = OmegaConf.to_container(OmegaConf.load(path)) or {}
    rest = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, value = item.split("=", 1)
        if key == "preset":
            preset = value
        else:
            rest.append(f"{key}={value}")
    preset = preset or file_cfg.pop("preset", None)
    file_cfg.pop("preset", None)
    if preset is not None:
        if preset not in PRESETS:
            raise ConfigError(f"unknown preset '{preset}'; choose one of {PRESETS}")
        cfg = _merge(cfg, OmegaConf.load(PRESET_DIR / f"{preset}.yaml"), f"preset {preset}")
    if file_cfg:
        cfg = _merge(cfg, file_cfg, str(config_file))
    for item in rest:
        cfg = _merge(cfg, OmegaConf.from_dotlist([item]), f"override {item}")
    return OmegaConf.to_object(cfg)


def to_dict(cfg: Config) -> dict[str, Any]:
    """The config as plain JSON-safe dicts (for checkpoints, logs and printing)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)


def from_dict(data: dict[str, Any]) -> Config:
    """Inverse of ``to_dict`` (how a config travels to a worker process, as JSON)."""
    return OmegaConf.to_object(_merge(OmegaConf.structured(Config), data, "a config dict"))


def save_resolved_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config as YAML (atomically), so tools can read a run's settings."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(OmegaConf.to_yaml(to_dict(cfg)))
    tmp.replace(path)
