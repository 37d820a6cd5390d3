"""A model family: everything that differs between architectures, in one object selected by `model.family`.

The trainer, the converter and the planner never name an architecture; they ask the family of the
config (`mgrpo.models.registry.family_of`) for
  - the Megatron TransformerConfig fields of the architecture and its decoder layer spec (local / TE),
  - the HF <-> Megatron name and shape table (which HF tensors make each Megatron parameter),
  - the HF config: build it, parse and check a checkpoint's config.json against a ModelConfig,
  - the parameter count (torch-free, for the planner),
  - the config checks of its own fields (`config_errors`) and the names of a transformers model's weights
    on disk (`hf_named_tensors`: transformers 5 fuses Qwen3-MoE's experts in memory, checkpoints do not).
What every GPT shares (parallel layout, CPU / Transformer Engine / FP8 switches, TP sharding rules,
safetensors I/O) lives in gpt.py, shapes.py, layout.py and hf_io.py. A new family (Llama, ...)
is one module defining a `ModelFamily` plus one line in registry.py; qwen3.py (dense) and qwen3_moe.py
(mixture of experts) are the examples.

Fields are plain functions so a family module stays declarative; a family module imports no torch at
module level (the planner reads parameter counts without it): heavy imports go inside the functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from mgrpo.models.shapes import LayerParams, Weight, gpt_param_counts


@dataclass(frozen=True)
class ModelFamily:
    name: str
    """The `model.family` value."""
    hf_model_type: str
    """config.json `model_type` of its HF checkpoints."""
    hf_architecture: str
    """config.json `architectures[0]`: the transformers class that loads the checkpoint."""

    megatron_config: Callable[[Any], dict]
    """ModelConfig -> TransformerConfig fields describing the architecture (sizes, norms, activation,
    biases). Parallel sizes, dtype, dropout and backend switches are added by gpt.py."""
    megatron_layer_spec: Callable[..., Any]
    """(use_te, ModelConfig) -> the decoder layer spec: Transformer Engine modules (True) or megatron's
    local ones."""
    megatron_model: Callable[[Any], dict]
    """ModelConfig -> GPTModel arguments beyond config, spec, vocabulary and stage (position embedding)."""

    hf_shapes: Callable[[Any], dict[str, tuple[int, ...]]]
    """ModelConfig -> every tensor of the HF checkpoint with its shape, in HF order."""
    stage_weights: Callable[..., list[Weight]]
    """(ModelConfig, *, layers, pre_process, post_process, param_names=None[, experts]) -> the Megatron
    parameters of one pipeline stage and the HF tensors each is made of, in export order. `layers` are
    the global indices of the stage's layers; `param_names` (the stage's parameter names) picks between
    spellings of the local and TE specs. A mixture-of-experts family also takes `experts`, the global
    indices of the rank's local experts (None: all of them), and lists them in local order; the list's
    order and Megatron names do not depend on which experts they are."""

    hf_config: Callable[..., Any]
    """(ModelConfig, *, dtype='float32', **extra) -> the transformers config of the same architecture."""
    hf_parse_config: Callable[[dict], Any]
    """config.json as a dict -> the transformers config object (defaults filled in)."""
    hf_model: Callable[[Any], Any]
    """transformers config -> a randomly initialised transformers model (transformers' own init)."""
    hf_unsupported: Callable[[Any, str], list[str]]
    """(transformers config, path) -> the variants of the architecture this family does not implement."""
    hf_model_fields: Callable[[Any], dict]
    """transformers config -> the ModelConfig architecture fields it describes."""
    hf_json_fields: Callable[[dict], dict]
    """config.json as a plain dict -> the same fields, without torch or transformers (the planner and the
    veRL front door read checkpoints this way); fields the file leaves out take transformers' defaults."""
    hf_checked_fields: Sequence[tuple[str, str]]
    """(config.json field, ModelConfig field) pairs a checkpoint must agree with the config on."""

    layer_params: Callable[[Any], LayerParams]
    """ModelConfig -> parameters of one decoder layer, by part."""

    default_tokenizer: Callable[[int], str] = lambda vocab_size: "synthetic"
    """vocab_size -> model.tokenizer for a checkpoint that ships no tokenizer files."""
    config_errors: Callable[[Any], list[str]] = lambda model: []
    """ModelConfig -> what the family cannot build from it, each naming the model.* field."""
    hf_named_tensors: Callable[[Any], dict] = lambda hf_model: dict(hf_model.named_parameters())
    """transformers model -> its weights under their checkpoint names (the names `hf_shapes` lists), as
    tensors sharing the parameters' memory: copying into one updates the model."""
    has_experts: bool = False
    """Its layers are mixture-of-experts layers (expert parallelism applies; `stage_weights` takes experts)."""

    def layer_spec(self, use_te: Optional[bool] = None, model=None):
        """The decoder layer spec of `model` (a ModelConfig); `use_te=None` picks Transformer Engine
        exactly when it can run here."""
        from mgrpo.models.capability import resolve_use_te

        return self.megatron_layer_spec(resolve_use_te(use_te), model)

    def param_counts(self, model, tp: int = 1, pp: int = 1, ep: int = 1) -> dict:
        """Parameters of the whole model (HF and megatron's padded layout) and per rank of each
        pipeline stage at this TP / PP / EP (see shapes.gpt_param_counts)."""
        return gpt_param_counts(self.layer_params(model), vocab_size=model.vocab_size, hidden_size=model.hidden_size,
                                num_layers=model.num_layers, tie_word_embeddings=model.tie_word_embeddings,
                                vocab_divisible_by=model.make_vocab_size_divisible_by, tp=tp, pp=pp, ep=ep)

    def megatron_names(self, model) -> dict[str, str]:
        """HF name -> Megatron name (global layer numbering, local spec), for error messages."""
        out: dict[str, str] = {}
        for w in self.stage_weights(model, layers=range(model.num_layers), pre_process=True, post_process=True):
            for name in w.hf:
                out.setdefault(name, w.megatron)
        return out


def hf_rope(cfg) -> tuple[float, dict]:
    """(rope_theta, rope parameters) of a transformers config, 4.x (rope_theta / rope_scaling) or
    5.x (rope_parameters) style; for families with rotary embeddings."""
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    return float(theta), params
