"""actor.offload in the plan: what the actor and the reference hold in each phase with each offload, and what the
engines gain from it: the largest rollout.gpu_memory_utilization that still fits beside the trainer while the
engines generate, and the KV-cache tokens that buys.

Where the trainer's memory goes (mgrpo/training/offload.py):
  generation   what actor.offload names is in host memory: actor weights (params), the fp32 gradient buffer
               (grads), Adam's states and fp32 master weights (optimizer), the reference (ref_params)
  other phases the actor's memory is back; the reference (ref_params) only during its own forward (log-probs)
KV cache of an engine (SGLang's static pool: rollout.gpu_memory_utilization of the card holds the weights and
the KV cache): per GPU, share - engine weights (bf16 HF weights / rollout.tp); per token
2 (k and v) x layers x max(kv_heads / rollout.tp, 1) x head_dim x 2 bytes (bf16).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

OFFLOADED_TERM = {"params": "actor_weights", "grads": "actor_grads", "optimizer": "optimizer_states",
                  "ref_params": "reference_weights"}
"""actor.offload.<key> -> the memory term it takes off the accelerator while the engines generate."""
ORDER = ("grads", "ref_params", "params", "optimizer")
"""Cheapest first by bytes copied per step: grads none (released, back as zeros), the reference in once, the
actor's weights out and in, Adam's states and master weights out and in (8-12 bytes per parameter, twice)."""


def apply(phases: dict, offload) -> None:
    """Take what `offload` (an OffloadConfig) moves to host memory out of the phases it is out in, in place."""
    for key, term in OFFLOADED_TERM.items():
        if getattr(offload, key) and "generation" in phases:
            phases["generation"].pop(term, None)
    if offload.ref_params:
        for name, terms in phases.items():
            if name != "log-probs":
                terms.pop("reference_weights", None)


def kv_bytes_per_token(model, rollout_tp: int) -> int:
    """One token's keys and values on one GPU of an engine (bf16)."""
    return 2 * model.num_layers * max(model.num_query_groups // rollout_tp, 1) * model.head_dim * 2


def engine_weights(hf_params: int, rollout_tp: int) -> int:
    return 2 * hf_params // rollout_tp


def kv_tokens(share: float, capacity: int, weights: int, per_token: int) -> int:
    """KV-cache tokens of one engine GPU whose static pool is `share` of `capacity`."""
    return max(int(share * capacity) - weights, 0) // per_token


def largest_share(mem, slack: float) -> float:
    """The largest rollout.gpu_memory_utilization the generation phase fits with (allocator slack included)."""
    held = sum(v for k, v in mem.phases["generation"].items() if k not in ("sglang_share", "allocator_slack"))
    return max(mem.capacity / (1 + slack) - held, 0) / mem.capacity


def table(cfg, estimate, *, slack: float, gpu_mem_gb: Optional[float] = None,
          dtype: Optional[str] = None) -> Optional[dict]:
    """Per offload choice (none, each alone, all): the trainer's bytes in every phase, the peak and whether it fits,
    the largest engine share that fits while generating and the KV tokens it buys, against no offload. None when
    no engine shares the trainer's accelerators (nothing to hand memory to)."""
    from mgrpo.config.offload import OffloadConfig
    from mgrpo.models.registry import param_counts  # the model family's count; imports no torch

    base = estimate(cfg, gpu_mem_gb=gpu_mem_gb, dtype=dtype)
    if "generation" not in base.phases:
        return None
    r, m = cfg.rollout, cfg.model
    per_token = kv_bytes_per_token(m, r.tp)
    weights = engine_weights(param_counts(m, cfg.actor.tp, cfg.actor.pp, cfg.actor.ep)["hf_total"], r.tp)
    choices = {"none": OffloadConfig(), **{k: OffloadConfig(**{k: True}) for k in ORDER},
               "all": OffloadConfig(**{k: True for k in ORDER}), "as configured": cfg.actor.offload}
    rows, tokens_none = {}, None
    for name, o in choices.items():
        mem = estimate(replace(cfg, actor=replace(cfg.actor, offload=o)), gpu_mem_gb=gpu_mem_gb, dtype=dtype)
        trainer = {p: sum(v for k, v in t.items() if not k.startswith("sglang") and k != "allocator_slack")
                   for p, t in mem.phases.items()}
        share = largest_share(mem, slack)
        tokens = kv_tokens(share, mem.capacity, weights, per_token)
        tokens_none = tokens if tokens_none is None else tokens_none
        rows[name] = {"keys": [f"actor.offload.{k}=true" for k in ORDER if getattr(o, k)],
                      "trainer_by_phase": trainer, "peak": mem.peak, "peak_phase": mem.peak_phase, "fits": mem.fits,
                      "largest_engine_share": round(share, 3), "kv_tokens_at_largest_share": tokens,
                      "kv_tokens_more_than_none": tokens - tokens_none}
    return {"kv_bytes_per_token": per_token, "engine_weights_per_gpu": weights,
            "kv_tokens_at_configured_share": kv_tokens(r.gpu_memory_utilization, base.capacity, weights, per_token),
            "configured_share": r.gpu_memory_utilization, "choices": rows}
