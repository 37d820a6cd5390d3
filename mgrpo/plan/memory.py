"""Per-accelerator memory of a run, the verdict (does it fit?) and the smallest change that fits.

No torch, no processes: this runs in mgrpo-plan and in the driver before anything starts
(`check_fits`). Every term is bytes on one Megatron rank of the heaviest pipeline stage.

Persistent (resident through the whole step):
  weights      params x 2 (bf16 on cuda) or 4 (fp32 on cpu)           actor.dtype, auto = bf16 on cuda
  grads        params x 4: megatron's DDP gradient buffer is fp32 (grad_reduce_in_fp32)
  optimizer    Adam m, v (8 B) + the fp32 master copy when weights are bf16 (4 B); divided by DP with
               actor.use_distributed_optimizer
  reference    params x weight bytes when a KL term needs it, sharded like the actor
  teacher      teacher.mode=megatron: its params x weight bytes, sharded like the actor (log-probs: the larger forward)
  context      CUDA context + cuBLAS workspace + NCCL buffers (CUDA_CONTEXT_GIB, an assumption)
Phases (the peak is the largest):
  generation   colocated SGLang holds rollout.gpu_memory_utilization of the card while the trainer
               keeps its persistent memory, less what actor.offload moves to host memory (offload.py)
  training     activations of the micro-batches in flight (1F1B: stage s of pp holds min(pp - s, M)),
               the log-prob head's working set on the last stage, the released SGLang engine's residue
  optimizer    on CPU torch's single-tensor Adam and megatron's clip-scale allocate up to two
               temporaries of the largest parameter
  weight sync  colocated SGLang's weights are back (its KV cache is not) + the bucket and the TP gather
Activations per decoder layer (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", the accounting behind megatron's 34sbh + 5as^2b, here term by term for Qwen3:
RMSNorm, GQA, q/k norms, SwiGLU, no dropout). With e bytes per element, T tokens of a micro-batch
(b sequences of s), t = TP size, dq = heads x head_dim, dkv = kv_heads x head_dim, f = ffn width:
  local spec (CPU, torch RMSNorm, torch's fused attention in mgrpo/models/attention.py: no s x s
  scores, no GQA-expanded keys and values; megatron's SwiGLU function, which keeps its input only, as
  on a GPU) — coefficients counted from the tensors autograd saves
  (tests/plan/test_plan_memory.py checks them):
    e T (6h + 3f/t + (5 + g) dq/t + 5 dkv/t + (2 nq + nkv)/t + 2) + 4 e s hd
  with g = 1 under GQA with more than one key/value head per rank, else 0 (the fused attention keeps
  q, k, v and its output in its own [b, h, s, d] layout and one log-sum-exp per query head)
  Transformer Engine spec (cuda: fused RMSNorm in LayerNormLinear, flash attention, fused SwiGLU):
    e T (4h + 3f/t + 3 dq/t + 3 dkv/t)
  full recompute (uniform, one layer per checkpoint): e T h per layer + one layer's full set.
Mixture-of-experts models (experts split over actor.ep, their MoE blocks, dispatcher buffers, the EP
gather of the weight sync, the routing-replay payload): moe.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Optional

from mgrpo.plan.activations import (Shape, backward_working_set, head_working_set, layer_activations,  # noqa: F401
                                    micro_batch_shape, stage_activations)
from mgrpo.plan.lora import adapter_counts
from mgrpo.plan.moe import (dispatch_buffers, ep_gather, is_moe, largest_exported, largest_layer_param,
                                      moe_backward_working_set, moe_block_activations, optimizer_states,
                                      routing_payload)
from mgrpo.config import ConfigError, Layout, MGRPOConfig, layout
from mgrpo.plan import offload as host_offload
from mgrpo.config.validate import default_dtype, resolved_device
from mgrpo.models.hf_config import teacher_model

GIB = 1024**3
MIB = 1024**2
DEFAULT_GPU_MEM_GIB = 80.0
CUDA_CONTEXT_GIB = 1.5
"""torch's CUDA context, cuBLAS workspace and NCCL communicator buffers of one trainer process on an H100:
usually 1-2 GiB. An assumption, not measured here (no GPU)."""
SGLANG_RELEASED_GIB = 1.5
"""What a colocated SGLang server keeps while its weights and KV cache are released (its CUDA context
and graph pools). An assumption, not measured here."""
CPU_RUNTIME_MIB = 16.0
"""A CPU rank's gloo process groups and megatron state beyond its imports (measured 15-19 MiB by
benchmarks/measure/plan_memory_cpu.py)."""
ALLOCATOR_SLACK = 0.05
"""PyTorch's caching allocator holds more than the live tensors (fragmentation): 5% on cuda."""


def device_of(cfg: MGRPOConfig) -> str:
    """The actor's device: trainer.device, 'auto' resolved (mgrpo.config.validate.resolved_device)."""
    return resolved_device(cfg.trainer.device)


def dtype_of(cfg: MGRPOConfig, device: str) -> str:
    return default_dtype(cfg.actor.dtype, device)


def param_counts(model, tp: int, pp: int, ep: int = 1) -> dict:
    from mgrpo.models.registry import param_counts as counts  # the model family's count; imports no torch

    return counts(model, tp, pp, ep)


LABELS = {
    "actor_weights": "actor weights", "actor_grads": "actor grads (fp32 buffer)",
    "optimizer_states": "optimizer (Adam m, v; + fp32 master with bf16)", "reference_weights": "reference weights",
    "teacher_weights": "teacher weights (on-policy distillation)",
    "cuda_context": "CUDA context, cuBLAS, NCCL (assumed)", "activations": "activations",
    "logprob_head": "log-prob head", "backward_working_set": "backward working set (one layer)",
    "gradient_transient": "gradient transient (largest parameter)", "cpu_runtime": "gloo groups, megatron state",
    "optimizer_temporaries": "Adam/clip temporaries (CPU)", "weight_sync_buckets": "weight-sync bucket",
    "tp_gather": "weight sync: TP gather of the largest tensor",
    "sglang_share": "SGLang share (rollout.gpu_memory_utilization)", "sglang_released": "SGLang released (assumed)",
    "sglang_weights": "SGLang weights (resumed for sync)", "allocator_slack": "allocator slack (5%)",
    "moe_dispatch": "MoE dispatcher buffers (one layer)", "routing_payload": "routing-replay payload",
    "ep_gather": "weight sync: EP gather of one expert",
}


@dataclass
class Memory:
    device: str
    dtype: str
    spec: str
    stage: int
    params: int
    terms: dict            # name -> bytes
    phases: dict           # phase -> {term: bytes}
    capacity: int
    shape: Optional[Shape] = None
    activations_by_recompute: Optional[dict] = None
    """Training activations of this stage with actor.recompute = None | selective | full."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda p: sum(self.phases[p].values()))

    @property
    def peak(self) -> int:
        return sum(self.phases[self.peak_phase].values())

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    @property
    def largest(self) -> tuple[str, int]:
        return max(self.phases[self.peak_phase].items(), key=lambda kv: kv[1])


def estimate(cfg: MGRPOConfig, lay: Optional[Layout] = None, *, gpu_mem_gb: Optional[float] = None,
             dtype: Optional[str] = None) -> Memory:
    """Every term and phase on the heaviest pipeline stage. `cfg` must be valid (validate first)."""
    return max(estimate_stages(cfg, lay, gpu_mem_gb=gpu_mem_gb, dtype=dtype), key=lambda mem: mem.peak)


def estimate_stages(cfg: MGRPOConfig, lay: Optional[Layout] = None, *, gpu_mem_gb: Optional[float] = None,
                    dtype: Optional[str] = None) -> list[Memory]:
    """The estimate of one rank of each pipeline stage."""
    lay = lay or layout(cfg)
    a, al, r, m = cfg.actor, cfg.algorithm, cfg.rollout, cfg.model
    device = device_of(cfg)
    dtype = dtype or dtype_of(cfg, device)
    w = 2 if dtype == "bf16" else 4
    spec = "te" if device == "cuda" else "local"
    recompute = cfg.actor.recompute
    counts = param_counts(m, a.tp, a.pp, a.ep)
    v_local = counts["padded_vocab"] // a.tp
    shape = micro_batch_shape(cfg, lay, device)
    engines_use_actor_gpus = device == "cuda" and r.shares_actor_devices
    moe = is_moe(m)
    layer_largest = largest_layer_param(m, a.tp) if moe else \
        max(v // a.tp for k, v in counts["per_layer"].items() if k != "norms")
    # the distributed optimizer shards dense states over DP, experts' over their expert-data-parallel ranks
    dp_shard = lay.dp if a.use_distributed_optimizer else 1
    tm = teacher_model(cfg.teacher.hf_path) if cfg.teacher.hf_path and cfg.teacher.mode == "megatron" else None
    edp_shard = a.tp * a.cp * lay.dp // a.ep if a.use_distributed_optimizer else 1
    stages = []
    for stage in range(a.pp):
        n = counts["per_rank_by_stage"][stage]
        vocab = stage == 0 or stage == a.pp - 1  # the embedding, or the output layer (a tied copy when pp > 1)
        largest_param = max(v_local * m.hidden_size if vocab else 0, layer_largest)
        # the largest HF tensor the weight sync gathers over TP: the vocabulary (not the tied copy on the
        # last stage, which HF does not have), or gate/up/q of a layer
        exported_vocab = stage == 0 or (stage == a.pp - 1 and not m.tie_word_embeddings)
        largest_full = max(counts["padded_vocab"] * m.hidden_size if exported_vocab else 0,
                           largest_exported(m) if moe else m.ffn_hidden_size * m.hidden_size,
                           m.num_attention_heads * m.head_dim * m.hidden_size)
        persistent = {
            "actor_weights": n * w,
            "actor_grads": n * 4,
            "optimizer_states": optimizer_states(n, counts["expert_per_rank_by_stage"][stage], 8 + (4 if w == 2 else 0),
                                                 dp_shard, edp_shard),
            "reference_weights": n * w if (al.use_kl_loss or al.use_kl_in_reward) else 0,
        }
        if tm is not None:  # on-policy distillation's Megatron teacher: frozen, sharded like the actor
            persistent["teacher_weights"] = param_counts(tm, a.tp, a.pp, a.ep)["per_rank_by_stage"][stage] * w
        if a.lora.enabled:  # the base frozen (weights only), the adapters trained, the reference = the base
            la, la_expert = (c[stage] for c in adapter_counts(m, a.lora, a.tp, a.pp, a.ep))
            persistent.update(actor_weights=(n + la) * w, actor_grads=la * 4, reference_weights=0,
                              optimizer_states=optimizer_states(la, la_expert, 8 + (4 if w == 2 else 0),
                                                                dp_shard, edp_shard))
            # no base weight has a gradient: the dense embedding gradient and the optimizer's temporaries are
            # those of the largest adapter tensor
            largest_param = a.lora.rank * max(m.hidden_size, m.ffn_hidden_size, m.moe_ffn_hidden_size or 0)
        if device == "cuda":
            persistent["cuda_context"] = int(CUDA_CONTEXT_GIB * GIB)
        else:
            persistent["cpu_runtime"] = int(CPU_RUNTIME_MIB * MIB)
        last = stage == a.pp - 1
        act = stage_activations(cfg, shape, stage, w, spec, recompute)
        train = {"activations": act, "backward_working_set": backward_working_set(m, shape, a.tp, w, spec),
                 "logprob_head": head_working_set(cfg, shape, v_local, w, training=True) if last else 0}
        fwd = {"activations": layer_activations(m, shape, a.tp, w, spec) + shape.tokens * m.hidden_size * w,
               "logprob_head": head_working_set(cfg, shape, v_local, w, training=False) if last else 0}
        if tm is not None:  # its forward runs after the reference's, never beside it: the larger of the two
            fwd["activations"] = max(fwd["activations"], layer_activations(tm, shape, a.tp, w, spec)
                                     + shape.tokens * tm.hidden_size * w)
        if moe:
            payload = routing_payload(m, str(a.router_replay) != "off",
                                      math.ceil((a.ppo_mini_batch_size or cfg.data.train_batch_size) * r.n / lay.dp),
                                      shape.seq_len, m.num_layers // a.pp)
            for p in (train, fwd):
                p["moe_dispatch"] = dispatch_buffers(m, shape.tokens, a.tp, w)
                if payload:
                    p["routing_payload"] = payload
        # A bucket never holds more than the stage's weights. At TP > 1 every tensor is gathered whole
        # (measured: twice the largest one at the peak, benchmarks/measure/plan_memory_cpu.py); at TP = 1 the
        # iteration hands out views of the parameters.
        sync = {"weight_sync_buckets": min(r.update_weights_bucket_mb * MIB, n * w),
                "tp_gather": 2 * largest_full * w if a.tp > 1 else 0}
        if moe:
            sync["ep_gather"] = ep_gather(m, a.ep, w)
        # the embedding's dense gradient comes last in the backward, after the activations are freed
        phases = {"training": train, "end of backward": {"gradient_transient": largest_param * w},
                  "log-probs": fwd, "weight sync": sync}
        if device == "cpu":
            phases["optimizer step"] = {"optimizer_temporaries": 2 * largest_param * 4}
        if engines_use_actor_gpus:
            released = int(SGLANG_RELEASED_GIB * GIB)
            for p in phases.values():
                p["sglang_released"] = released
            sync["sglang_weights"] = 2 * counts["hf_total"] // r.tp
        capacity = int((gpu_mem_gb or getattr(cfg.trainer, "gpu_memory_gb", None) or DEFAULT_GPU_MEM_GIB) * GIB) \
            if device == "cuda" else _host_memory() // max(lay.megatron_world // cfg.trainer.nnodes, 1)
        full = {p: {**persistent, **t} for p, t in phases.items()}
        if engines_use_actor_gpus:
            full["generation"] = {**persistent, "sglang_share": int(r.gpu_memory_utilization * capacity)}
        host_offload.apply(full, a.offload)
        if device == "cuda":
            for p in full.values():
                p["allocator_slack"] = int(ALLOCATOR_SLACK * sum(p.values()))
        terms = dict(persistent)
        for t in full.values():  # a term that appears in several phases: its largest value
            for k, v in t.items():
                terms[k] = max(terms.get(k, 0), v)
        by_recompute = {str(rc): stage_activations(cfg, shape, stage, w, spec, rc) for rc in (None, "selective", "full")}
        stages.append(Memory(device, dtype, spec, stage, n, terms, full, capacity, shape, by_recompute))
    return stages


def _host_memory() -> int:
    """Physical memory of this machine (CPU runs: all ranks of a node share it)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# --- the verdict ---------------------------------------------------------------------------------------
# Knobs the search may turn, cheapest first: (name, cost of one step). Recompute only once the schema
# has actor.recompute (the trainer must honour what the planner suggests).
KNOB_COST = {"actor.offload": 1, "actor.use_distributed_optimizer": 1, "actor.recompute": 2, "actor.max_tokens_per_gpu": 3,
             "rollout.gpu_memory_utilization": 3, "actor.ep": 4, "actor.tp": 5, "actor.pp": 6}


@dataclass
class Verdict:
    memory: Memory
    suggestion: Optional[list[str]] = None
    """Overrides (key=value) of the smallest change found that fits, checked by recomputing."""
    suggested: Optional[Memory] = None

    @property
    def fits(self) -> bool:
        return self.memory.fits

    def message(self) -> str:
        m = self.memory
        where = "GPU" if m.device == "cuda" else "rank (host memory shared by the node's ranks)"
        name, size = m.largest
        head = (f"{'FITS' if m.fits else 'DOES NOT FIT'}: peak {m.peak / GIB:.1f} GiB per {where} in the "
                f"{m.peak_phase} phase, of {m.capacity / GIB:.1f} GiB; largest term: {LABELS[name]} "
                f"{size / GIB:.1f} GiB")
        if m.fits:
            return head
        if self.suggestion:
            s = self.suggested
            return (f"{head}\n  fits with: {' '.join(self.suggestion)} (peak {s.peak / GIB:.1f} GiB in the "
                    f"{s.peak_phase} phase, recomputed)")
        return f"{head}\n  no change of {', '.join(KNOB_COST)} within this cluster fits: add nodes or GPUs"


def _candidates(cfg: MGRPOConfig, lay: Layout, device: str):
    """(changes, (number of knobs, cost)) for every combination of at most four knob changes."""
    import itertools

    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    per_node = lay.total // t.nnodes
    options: dict[str, list] = {}
    if device == "cuda" and not a.use_distributed_optimizer and lay.dp > 1:
        options["actor.use_distributed_optimizer"] = [(True, 1)]
    if a.recompute != "full":
        options["actor.recompute"] = [("full", 1)]
    # host memory while the engines generate (and the reference out of training), each set costing its switches'
    # ranks in ORDER (bytes copied per step): the one that copies nothing, the one that frees most, all of them
    # (three sets, not all fifteen: the search estimates every combination when nothing fits)
    off = [k for k in host_offload.ORDER if not getattr(a.offload, k)]
    sets = {tuple(k for k in s if k in off) for s in (("grads",), ("optimizer",), host_offload.ORDER)} - {()}
    options["actor.offload"] = sorted((s, sum(host_offload.ORDER.index(k) + 1 for k in s)) for s in sets)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    options["actor.max_tokens_per_gpu"] = [(a.max_tokens_per_gpu // 2 ** k, k) for k in (1, 2, 3)
                                           if a.max_tokens_per_gpu // 2 ** k >= seq]
    if device == "cuda" and r.shares_actor_devices:
        options["rollout.gpu_memory_utilization"] = [
            (round(u, 2), round((r.gpu_memory_utilization - u) * 10)) for u in (0.6, 0.5, 0.4, 0.3)
            if u < r.gpu_memory_utilization - 1e-9]
    if is_moe(cfg.model):  # experts split over more ranks (validation keeps the layouts that divide)
        options["actor.ep"] = [(a.ep * 2 ** k, k) for k in (1, 2, 3, 4) if cfg.model.num_experts % (a.ep * 2 ** k) == 0]
    options["actor.tp"] = [(a.tp * 2 ** k, k) for k in (1, 2, 3) if a.tp * 2 ** k * a.cp <= per_node]
    options["actor.pp"] = [(a.pp * 2 ** k, k) for k in (1, 2, 3) if a.pp * 2 ** k <= cfg.model.num_layers]
    knobs = [k for k in options if options[k]]
    for n in (1, 2, 3, 4):
        for combo in itertools.combinations(knobs, n):
            for values in itertools.product(*(options[k] for k in combo)):
                cost = sum(KNOB_COST[k] + steps for k, (_, steps) in zip(combo, values))
                yield dict(zip(combo, (v for v, _ in values))), (n, cost)


def _with(cfg: MGRPOConfig, changes: dict) -> MGRPOConfig:
    out = cfg
    for key, value in changes.items():
        if key == "actor.offload":  # a group of switches: the names turned on
            on = replace(out.actor.offload, **{k: True for k in value})
            out = replace(out, actor=replace(out.actor, offload=on))
            continue
        group, name = key.split(".")
        out = replace(out, **{group: replace(getattr(out, group), **{name: value})})
    return out


def suggest(cfg: MGRPOConfig, *, gpu_mem_gb: Optional[float] = None, dtype: Optional[str] = None):
    """The cheapest change (fewest knobs, then the cheapest knobs) that is valid and fits, or None."""
    from mgrpo.config import validate

    lay = layout(cfg)
    device = device_of(cfg)
    for changes, _ in sorted(_candidates(cfg, lay, device), key=lambda c: c[1]):
        new = _with(cfg, changes)
        try:
            new_lay = validate(new, check_files=False)
        except ConfigError:
            continue
        mem = estimate(new, new_lay, gpu_mem_gb=gpu_mem_gb, dtype=dtype)
        if mem.fits:
            return [s for k, v in changes.items() for s in (
                [f"actor.offload.{n}=true" for n in v] if k == "actor.offload" else
                [f"{k}={str(v).lower() if isinstance(v, bool) else v}"])], mem
    return None, None


def verdict(cfg: MGRPOConfig, lay: Optional[Layout] = None, *, gpu_mem_gb: Optional[float] = None,
            dtype: Optional[str] = None) -> Verdict:
    mem = estimate(cfg, lay, gpu_mem_gb=gpu_mem_gb, dtype=dtype)
    if mem.fits:
        return Verdict(mem)
    overrides, suggested = suggest(cfg, gpu_mem_gb=gpu_mem_gb, dtype=dtype)
    return Verdict(mem, overrides, suggested)


def check_fits(cfg: MGRPOConfig, *, gpu_mem_gb: Optional[float] = None) -> Verdict:
    """The memory check mgrpo-train runs before starting any process. Raises ConfigError naming the
    largest term and a change that fits, unless trainer.allow_oversubscribe is true. `cfg` must be
    valid; the card's memory is `gpu_mem_gb`, else trainer.gpu_memory_gb, else 80 GiB."""
    v = verdict(cfg, gpu_mem_gb=gpu_mem_gb)
    if not v.fits and not cfg.trainer.allow_oversubscribe:
        raise ConfigError(f"the run does not fit in memory (mgrpo-plan shows every term):\n  {v.message()}\n"
                          "  trainer.allow_oversubscribe=true starts it anyway")
    return v
