"""Memory terms of a mixture-of-experts model (model.num_experts > 0) for the planner (memory.py).

No torch. A MoE layer runs sequence parallel at TP > 1 (mgrpo.models.gpt), so a rank's MoE block sees
T' = T / tp of a micro-batch's T tokens; each is routed to k of E experts, and with the routing balanced
over the expert-parallel group a rank's experts take T' k rows (dropless: more on an overloaded rank).

Activations of the MoE block (local spec: megatron's router, alltoall dispatcher and SequentialMLP),
counted from what autograd saves (tests/plan/test_plan_memory.py checks them byte for byte at TP 1 and 2):
  per routed row   e (h + 3 I) + 24 B   expert input, SwiGLU input (megatron's SwiGLU function keeps only
                                        that, as on a GPU) and fc2 input; int64 permutation indices and fp32
                                        probabilities
  per token        5 E B                fp32 routing probabilities and the bool routing map
                   + 6 E B              with the load-balancing loss (its fp32 scores and map)
The Transformer Engine spec (grouped GEMM, fused SwiGLU) is assumed to keep the same e (h + 3 I) per routed
row, as its dense MLP keeps 3f per token (not measured: no GPU here). The attention part is the dense layer's
(memory.layer_activations with no MLP) with its norm and residual terms split tp ways.

Beyond activations: the dispatcher's send and receive buffers of one layer (T' k rows of h, twice), the
weight sync's gather of one local expert over the EP group, the optimizer states of the experts sharded
over the expert-data-parallel ranks (tp x cp x dp / ep) with the distributed optimizer, and, with
routing replay on, the experts chosen for every token of the rank's mini-batch in every layer of the
stage (int64, megatron's top-k indices): the routing payload.
"""

from __future__ import annotations


def is_moe(m) -> bool:
    return bool(getattr(m, "num_experts", 0))


def moe_block_activations(m, tokens: int, tp: int, e: int, aux: bool) -> int:
    """Bytes the MoE block of one layer saves for a micro-batch of `tokens` tokens (before SP)."""
    t = tokens // tp
    rows = t * m.moe_router_topk
    per_row = e * (m.hidden_size + 3 * m.moe_ffn_hidden_size) + 24
    return rows * per_row + t * m.num_experts * (5 + (6 if aux else 0))


def moe_backward_working_set(m, tokens: int, tp: int, e: int) -> int:
    """Gradients alive while one MoE block runs backward: the SwiGLU input and output of the routed rows."""
    return e * (tokens // tp) * m.moe_router_topk * (4 * m.moe_ffn_hidden_size + m.hidden_size)


def dispatch_buffers(m, tokens: int, tp: int, e: int) -> int:
    """The alltoall dispatcher's permuted tokens and what arrives for this rank's experts (one layer)."""
    return 2 * e * (tokens // tp) * m.moe_router_topk * m.hidden_size


def largest_layer_param(m, tp: int) -> int:
    """The largest single parameter of a MoE layer on one rank (experts are whole, never split by TP)."""
    h = m.hidden_size
    return max((m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim * h // tp,
               m.num_attention_heads * m.head_dim * h // tp, m.num_experts * h, 2 * m.moe_ffn_hidden_size * h)


def largest_exported(m) -> int:
    """The largest HF tensor of a MoE layer the weight sync emits whole (q_proj, the router, an expert)."""
    return max(m.num_attention_heads * m.head_dim, m.num_experts, m.moe_ffn_hidden_size) * m.hidden_size


def ep_gather(m, ep: int, e: int) -> int:
    """Weight sync: one local expert's [gate; up] gathered from the EP group, and its halves made contiguous."""
    return 2 * ep * 2 * m.moe_ffn_hidden_size * m.hidden_size * e if ep > 1 else 0


def optimizer_states(n: int, n_expert: int, per_param: int, dp_shard: int, edp_shard: int) -> int:
    """Adam states of a rank's dense parameters (sharded dp_shard ways) and experts (edp_shard ways)."""
    return (n - n_expert) * per_param // dp_shard + n_expert * per_param // edp_shard


def routing_payload(m, replay: bool, samples: int, seq_len: int, layers: int) -> int:
    """Routing replay (actor.router_replay != off): every token's k experts in each of the stage's layers, for
    the rank's mini-batch, as the int64 indices megatron's RouterReplay takes."""
    if not replay:
        return 0
    return samples * seq_len * layers * m.moe_router_topk * 8
