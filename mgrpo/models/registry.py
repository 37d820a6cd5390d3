"""The model families a config may name (`model.family`) and how a config or a checkpoint finds its own.

Imports no torch: `mgrpo.preflight` checks `model.family` here and the planner counts
parameters through `param_counts`. A new family is its module (see qwen3.py) and one entry below.
"""

from __future__ import annotations

from mgrpo.config.registry import Registry
from mgrpo.models.family import ModelFamily
from mgrpo.models.qwen3 import QWEN3
from mgrpo.models.qwen3_moe import QWEN3_MOE

FAMILIES: Registry[ModelFamily] = Registry("model.family", {QWEN3.name: QWEN3, QWEN3_MOE.name: QWEN3_MOE})


def family_of(model) -> ModelFamily:
    """The family of a ModelConfig (ValueError naming model.family and the registered ones)."""
    return FAMILIES.lookup(model.family)


def family_for_hf(model_type, path: str = "config.json") -> ModelFamily:
    """The family whose HF checkpoints have this config.json `model_type`."""
    for family in FAMILIES.values():
        if family.hf_model_type == model_type:
            return family
    known = " or ".join(repr(f.hf_model_type) for f in FAMILIES.values())
    raise ValueError(f"{path}: model_type={model_type!r}, expected {known} (model families: {list(FAMILIES)})")


def param_counts(model, tp: int = 1, pp: int = 1, ep: int = 1) -> dict:
    """Parameter counts of a ModelConfig by its family (see ModelFamily.param_counts)."""
    return family_of(model).param_counts(model, tp, pp, ep)


def hf_named_tensors(hf_model) -> dict:
    """A transformers model's weights under their checkpoint names (views of its parameters), by the
    family of its config's model_type; a model of no registered family has its parameters' own names."""
    model_type = getattr(hf_model.config, "model_type", None)
    for family in FAMILIES.values():
        if family.hf_model_type == model_type:
            return family.hf_named_tensors(hf_model)
    return dict(hf_model.named_parameters())
