"""Typed configs with YAML files and ``a.b=c`` overrides."""

from creditrl.config.schema import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    AsyncConfig,
    Config,
    CriticConfig,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RayConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
)

__all__ = [
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "AsyncConfig",
    "Config",
    "CriticConfig",
    "DataConfig",
    "ModelConfig",
    "OptimConfig",
    "RayConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainerConfig",
]
