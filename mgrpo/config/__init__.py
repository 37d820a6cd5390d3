"""Typed run configuration (Hydra structured configs), its closed choices and its field-local checks.

  schema.py       the dataclasses, one docstring per field
  multi_turn.py   rollout.multi_turn's group
  reward.py       reward.*'s groups (rules, reward models, failed samples)
  sandbox.py      sandbox.*'s group
  algorithm.py    algorithm.*'s groups (the objective, dynamic sampling, overlong shaping)
  lora.py         actor.lora: the adapters' group, targets and checks
  offload.py      actor.offload's group
  teacher.py      teacher.* and algorithm.opd.* (on-policy distillation)
  choices.py      the closed choices (StrEnums)
  registry.py     named (open) choices and what each one is
  validate.py     the one validator: field-local checks, every message naming its key
  checks.py       checks of single groups, collected by the validator
  seeds.py        every seed a run derives from its config
  vocab.py        the model vocabulary that follows the tokenizer (a Hydra resolver)
"""

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
