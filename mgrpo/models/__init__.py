"""Model families as Megatron-Core models, and their weights in Hugging Face and Megatron formats.

  family.py        ModelFamily: what differs between architectures (Megatron config and layer spec,
                   HF <-> Megatron names, HF config, parameter count)
  registry.py      the families `model.family` may name; family_of(model), family_for_hf(model_type)
  qwen3.py         the Qwen3 (dense) family
  qwen3_moe.py     the Qwen3-MoE family (routed experts, expert parallelism)
  gpt.py           any family as a megatron GPTModel: TransformerConfig at a parallel layout, layer
                   spec, stage builder (local spec on CPU, TE + FP8 on GPU), THD packed-sequence parameters
  shapes.py        padded vocabulary, TP shard shapes (experts whole on their EP rank), parameter counts (no torch)
  capability.py    can Transformer Engine / FP8 run here (asked at call time)
  layout.py        one TP rank's shard from HF tensors and back (pure tensors)
  hf_config.py     config.json read and checked against ModelConfig without torch
  hf_io.py         config.json -> ModelConfig, lazy safetensors reads, sharded writes, random init
  hf_checkpoint.py load an HF directory into a stage (each rank reads only its slices)
  weight_iter.py   stream a stage out as HF tensors (TP gather per parameter, EP gather per expert); buckets
  megatron_ckpt.py megatron distributed checkpoints of the weights (reshard on load)
  peft_export.py   Megatron LoRA adapters -> a Hugging Face PEFT adapter folder
  attention.py     core attention for the local spec (packed, context-parallel, padded) through torch's
                   fused attention
  attention_layout.py  which tokens a context-parallel rank holds
  rope.py          megatron's unfused THD RoPE without its per-sequence loop (bitwise the same)

The names below are imported on first use, not with the package: family.py, registry.py, qwen3.py,
qwen3_moe.py, shapes.py and capability.py import no torch, and mgrpo.preflight and the planner read them
without importing torch.
"""

from mgrpo.config.registry import lazy_exports

_EXPORTS = {
    "bucketize": "weight_iter",
    "build_gpt_model": "gpt",
    "check_hf_config": "hf_config",
    "family_of": "registry",
    "init_hf_checkpoint": "hf_io",
    "iter_megatron_to_hf": "weight_iter",
    "load_hf_into_megatron": "hf_checkpoint",
    "load_megatron_checkpoint": "megatron_ckpt",
    "model_config_from_hf": "hf_io",
    "save_hf_checkpoint": "hf_io",
    "save_hf_checkpoint_distributed": "weight_iter",
    "save_megatron_checkpoint": "megatron_ckpt",
    "transformer_config": "gpt",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
