"""Megatron LoRA adapters -> a Hugging Face PEFT adapter (adapter_config.json + adapter_model.safetensors).

The adapters' factors go through the same layout conversion as the weights they adapt (`hf_from_shards`), with
the rank in place of the input dimension: a column-parallel linear's B is split by rows exactly like its
weight (megatron's fused q/k/v by query group, gate/up per TP shard) and its A is shared by every HF part (the
fused linear has one input), so PEFT's q_proj, k_proj and v_proj each get lora_A = A and their rows of B; a
row-parallel linear's A is split by columns like its weight and B is whole. Dense models only: transformers
keeps a Qwen3-MoE's experts as fused 3-D parameters, which PEFT's LoRA layers do not adapt per expert, so an
adapter on experts is exported merged (the HF checkpoint) and not as PEFT.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

import torch

from mgrpo.models.hf_checkpoint import Stage, check_stage_layout
from mgrpo.models.layout import hf_from_shards
from mgrpo.models.shapes import EXPERT_KINDS, QKV, FC1, ROW_PARALLEL

ADAPTED = (QKV, FC1, ROW_PARALLEL)


def iter_peft_tensors(model, model_cfg, *, tp_group, tp_size: int, pp_rank: int,
                      pp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT key, full tensor) of this stage's adapters; every TP rank of the stage iterates (gathers)."""
    from mgrpo.models.weight_iter import _gather

    stage = Stage.of(model)
    d = check_stage_layout(model_cfg, stage, tp_size, pp_rank, pp_size)
    modules = dict(model.named_modules())
    for w in stage.weights(model_cfg):
        module = modules.get(w.megatron.rsplit(".", 1)[0])
        p = stage.params.get(w.megatron)
        if p is not None and p.requires_grad and w.kind not in ADAPTED + EXPERT_KINDS:
            # trained whole (PEFT's modules_to_save: the embedding, the output layer): saved whole, under its
            # module's name as PEFT saves it (base_model.model.<module>.weight)
            shards = p.detach().unsqueeze(0) if tp_size == 1 else _gather(p.detach(), tp_group, tp_size)
            for hf_name, part in hf_from_shards(w, shards, d):
                yield "base_model.model." + hf_name, part.contiguous()
            continue
        if module is None or not hasattr(module, "lora_A"):
            continue
        if w.kind in EXPERT_KINDS:
            raise ValueError("a PEFT adapter cannot hold adapters on a Qwen3-MoE's experts (transformers fuses "
                             "them); use the merged HF checkpoint")
        if w.kind not in ADAPTED:
            raise ValueError(f"no PEFT layout for an adapter on {w.megatron} ({w.kind})")
        A, B = module.lora_A.detach(), module.lora_B.detach()
        rank_dims = dataclasses.replace(d, hidden=A.shape[0])
        split = A if w.kind == ROW_PARALLEL else B
        shards = split.unsqueeze(0) if tp_size == 1 else _gather(split, tp_group, tp_size)
        parts = list(hf_from_shards(w, shards, rank_dims))
        for hf_name, part in parts:
            prefix = "base_model.model." + hf_name.rsplit(".", 1)[0]
            a, b = (part, B) if w.kind == ROW_PARALLEL else (A, part)
            yield prefix + ".lora_A.weight", a.contiguous()
            yield prefix + ".lora_B.weight", b.contiguous()


def peft_config(tensors: dict, lora, base_dir: str, tied: bool = False) -> dict:
    """adapter_config.json's fields (PEFT's LoraConfig) for these adapter tensors. Modules trained whole
    (modules_to_save) are named as the tensors hold them; with tied embeddings PEFT ties the output layer to the
    saved embedding (ensure_weight_tying)."""
    targets = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors if ".lora_" in k})
    saved = sorted({k.rsplit(".", 2)[-2] for k in tensors if ".lora_" not in k})
    extra = {"modules_to_save": saved, "ensure_weight_tying": tied} if saved else {}
    return {**extra, "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_dir,
            "r": int(lora.rank), "lora_alpha": float(lora.alpha), "lora_dropout": float(lora.dropout),
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "init_lora_weights": True, "inference_mode": True}


def write_peft_adapter(out_dir: str, tensors: dict, lora, base_dir: str, tied: bool = False) -> None:
    """adapter_config.json (PEFT's LoraConfig fields) and adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    config = peft_config(tensors, lora, base_dir, tied)
    emb = "base_model.model.model.embed_tokens.weight"
    if tied and emb in tensors:  # PEFT ties lm_head to the saved embedding and loads it under its own name too
        tensors = {**tensors, "base_model.model.lm_head.weight": tensors[emb]}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=1)
    save_file({k: v.detach().to("cpu", torch.float32).clone() for k, v in tensors.items()},  # fused parts share A
              os.path.join(out_dir, "adapter_model.safetensors"))
