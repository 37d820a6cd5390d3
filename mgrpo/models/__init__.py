"""Qwen3 as a Megatron-Core model, and its weights in Hugging Face and Megatron formats.

  qwen3.py         TransformerConfig / layer spec / GPTModel builder (local spec on CPU, TE + FP8 on GPU),
                   THD packed-sequence parameters, the matching transformers Qwen3Config
  capability.py    can Transformer Engine / FP8 run here (asked at call time)
  layout.py        HF <-> Megatron names and tensor-parallel sharding rules (pure tensors)
  hf_io.py         config.json <-> ModelConfig, lazy safetensors reads, sharded writes, random init
  hf_checkpoint.py load an HF directory into a stage (each rank reads only its slices)
  weight_iter.py   stream a stage out as HF tensors (TP gather per parameter); buckets
  megatron_ckpt.py megatron distributed checkpoints of the weights (reshard on load)
"""

from mgrpo.models.hf_checkpoint import load_hf_into_megatron
from mgrpo.models.hf_io import (check_hf_config, init_hf_checkpoint, model_config_from_hf,
                                save_hf_checkpoint)
from mgrpo.models.megatron_ckpt import load_megatron_checkpoint, save_megatron_checkpoint
from mgrpo.models.weight_iter import bucketize, iter_megatron_to_hf, save_hf_checkpoint_distributed

__all__ = [
    "bucketize", "check_hf_config", "init_hf_checkpoint", "iter_megatron_to_hf", "load_hf_into_megatron",
    "load_megatron_checkpoint", "model_config_from_hf", "save_hf_checkpoint", "save_hf_checkpoint_distributed",
    "save_megatron_checkpoint",
]
