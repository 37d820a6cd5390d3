"""Typed run configuration (Hydra structured configs), its closed choices and its field-local checks."""

from mgrpo.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    DataConfig,
    EvaluationConfig,
    FailedSamplesConfig,
    FilterGroupsConfig,
    MGRPOConfig,
    ModelConfig,
    OverlongBufferConfig,
    RewardConfig,
    RolloutConfig,
    SandboxConfig,
    TrainerConfig,
)
from mgrpo.config.validate import ConfigError, InputError, Layout, layout, output_dir, resolve_device, validate

__all__ = [
    "ActorConfig", "AlgorithmConfig", "ConfigError", "InputError", "DataConfig", "EvaluationConfig",
    "FailedSamplesConfig", "FilterGroupsConfig",
    "Layout", "MGRPOConfig", "ModelConfig", "OverlongBufferConfig", "RewardConfig", "RolloutConfig", "SandboxConfig",
    "TrainerConfig", "layout", "output_dir", "resolve_device", "validate",
]
