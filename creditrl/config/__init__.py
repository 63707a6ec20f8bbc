"""Typed configs with YAML files and ``a.b=c`` overrides, checked in one place (``validate``)."""

from creditrl.config.fields import Range
from creditrl.config.loader import LoadedConfig, load_config, load_config_with_sources
from creditrl.config.options import Option
from creditrl.config.schema import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    AsyncConfig,
    Config,
    CriticConfig,
    DataConfig,
    DistillConfig,
    ModelConfig,
    OptimConfig,
    RayConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)
from creditrl.config.validate import unused_settings, validate_config

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "Config",
    "CriticConfig",
    "DataConfig",
    "DistillConfig",
    "LoadedConfig",
    "ModelConfig",
    "OptimConfig",
    "Option",
    "Range",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
    "load_config",
    "load_config_with_sources",
    "unused_settings",
    "validate_config",
]
