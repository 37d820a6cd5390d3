"""Tiny Qwen3-MoE configurations and checkpoints shared by the MoE tests: the trainer-side layouts (TP/PP/CP/EP
with the load-balancing loss), the CPU rollout server's routing (routes recomputed from the weights as an
independent reference), and the MoE default job."""

from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np
import torch
from safetensors.torch import load_file

from mgrpo.config import MGRPOConfig
from mgrpo.rollout.types import GenerateRequest
from tests.helpers.convert import tiny_cfg


AUX = 0.05  # large enough that a wrong load-balancing gradient shows at 1e-5


def moe_cfg(**kw):
    """tiny_cfg's attention (GQA, head_dim 24 != 64/4, 4 layers, untied, vocabulary 100) with 6 experts of
    width 40, 2 per token."""
    return tiny_cfg(family="qwen3_moe", num_experts=6, moe_ffn_hidden_size=40, moe_router_topk=2,
                    max_position_embeddings=128, **kw)


def run_config(*, tp=1, pp=1, cp=1, ep=1, packed=True, budget=256, aux=0.0) -> MGRPOConfig:
    cfg = MGRPOConfig()
    return dataclasses.replace(
        cfg, model=moe_cfg(router_aux_loss_coef=aux),
        algorithm=dataclasses.replace(cfg.algorithm, use_kl_loss=True, kl_coef=0.05, entropy_coeff=0.01),
        actor=dataclasses.replace(cfg.actor, tp=tp, pp=pp, cp=cp, ep=ep, pack_sequences=packed,
                                  max_tokens_per_gpu=budget, lr=1e-2, grad_clip=1e9),
        trainer=dataclasses.replace(cfg.trainer, device="cpu"))


LAYERS, EXPERTS, TOP_K = 2, 8, 2
REQS = [GenerateRequest(uid=i, prompt_ids=[1, 3 + i, 5, 7, 2][: 2 + i % 4]) for i in range(5)]


def moe_checkpoint(out_dir: str, seed: int = 0) -> str:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=16, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=128,
                         tie_word_embeddings=False, eos_token_id=15, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers far from uniform, so no top-k choice is a near tie
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    return out_dir


@functools.lru_cache(maxsize=2)
def _loaded(ckpt: str, mtime: float):
    """The checkpoint's gate weights and its transformers model, loaded once per checkpoint file version."""
    from transformers import AutoModelForCausalLM

    tensors = load_file(os.path.join(ckpt, "model.safetensors"))
    gates = {k: v for k, v in tensors.items() if k.endswith("mlp.gate.weight")}
    return gates, AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def recomputed_routes(ckpt: str, ids: list[int]) -> np.ndarray:
    """The router's top-k for every position of `ids`, from the checkpoint's own `mlp.gate.weight` tensors:
    softmax(x W^T) then top-k, where x is each layer's router input (its post-attention RMSNorm output) from
    a plain full-sequence transformers forward."""
    gates, model = _loaded(ckpt, os.path.getmtime(os.path.join(ckpt, "model.safetensors")))
    inputs: dict[int, torch.Tensor] = {}
    hooks = [layer.post_attention_layernorm.register_forward_hook(
        lambda m, a, out, i=i: inputs.__setitem__(i, out[0])) for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    rows = []
    for i in range(LAYERS):
        probs = torch.softmax(inputs[i] @ gates[f"model.layers.{i}.mlp.gate.weight"].T, dim=-1)
        rows.append(torch.topk(probs, TOP_K, dim=-1).indices)
    return torch.stack(rows, dim=1).numpy().astype(np.int32)  # [seq, layers, top_k]


# rollout=hf_cpu: the in-process transformers engine, inside trainer rank 0 (the SGLang-protocol CPU server
# learns to serve Qwen3-MoE elsewhere)
HF_ENGINE = {"engine": "hf", "mode": "hybrid"}


def tiny_moe(**kw) -> dict:
    from mgrpo_launchers.plan import compose_config

    model = compose_config(["model=tiny-moe"]).model
    return {**{f: getattr(model, f) for f in ("name", "family", "num_experts", "moe_ffn_hidden_size",
                                               "moe_router_topk", "norm_topk_prob")},
            "router_aux_loss_coef": 0.0, **kw}
