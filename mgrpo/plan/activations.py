"""The activation terms of the memory plan: the largest micro-batch a rank runs, what autograd keeps for it per
decoder layer and per stage, the backward's working set and the log-prob head's (formulas in memory.py's module
doc). No torch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mgrpo.config import Layout, MGRPOConfig
from mgrpo.plan.moe import (dispatch_buffers, ep_gather, is_moe, largest_exported, largest_layer_param,
                                      moe_backward_working_set, moe_block_activations, optimizer_states,
                                      routing_payload)


@dataclass(frozen=True)
class Shape:
    """The largest micro-batch one rank runs."""

    tokens: int          # T (padded tokens count on CPU, whose local attention takes [b, s] batches)
    seqs: int            # b
    seq_len: int         # s
    response_tokens: int  # positions that reach the log-prob head
    in_flight: int       # micro-batches whose activations the first pipeline stage holds at once


def micro_batch_shape(cfg: MGRPOConfig, lay: Layout, device: str) -> Shape:
    """Token budget actor.max_tokens_per_gpu over max-length sequences (the worst case), capped by the
    samples a rank gets per mini-batch; THD packing on cuda, padded [b, s] batches on cpu."""
    d, a = cfg.data, cfg.actor
    s = d.max_prompt_length + d.max_response_length
    mini = a.ppo_mini_batch_size or d.train_batch_size
    per_rank = max(math.ceil(mini * cfg.rollout.n / lay.dp), 1)
    # a micro-batch spans the CP group: cp x the per-GPU budget, each CP rank holding 1/cp of it
    # (mgrpo.training.actor.MegatronActor.token_budget)
    budget = a.max_tokens_per_gpu * a.cp
    b = max(min(budget // s, per_rank), 1)
    micro = math.ceil(per_rank / b)
    # cuda packs sequences end to end (THD), so shorter ones fill the whole budget; cpu pads [b, s]
    packed = device == "cuda" or getattr(a, "pack_sequences", False)
    tokens = min(budget, per_rank * s) if packed else b * s
    return Shape(tokens=tokens // a.cp, seqs=b, seq_len=s // a.cp,
                 response_tokens=tokens * d.max_response_length // s // a.cp, in_flight=min(a.pp, micro))


def layer_activations(m, shape: Shape, tp: int, e: int, spec: str) -> int:
    """Bytes autograd keeps for one decoder layer of one micro-batch (formulas in the module doc; a
    mixture-of-experts layer: its attention as a dense layer's without the MLP, sequence parallel at
    TP > 1, plus its MoE block, see moe.py)."""
    h, nq, nkv, hd = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    moe = is_moe(m)
    f = 0 if moe else m.ffn_hidden_size
    sp = tp if moe else 1  # sequence parallelism splits the norms' and residuals' tokens
    dq, dkv, T = nq * hd, nkv * hd, shape.tokens
    extra = moe_block_activations(m, T, tp, e, aux=m.router_aux_loss_coef > 0) if moe else 0
    if spec == "te":
        return e * (T * 4 * h // sp + T * ((3 * f + 3 * dq + 3 * dkv) // tp)) + extra
    # torch's fused attention (mgrpo/models/attention.py) keeps q, k, v and its output in its own
    # [b, h, s, d] layout, a log-sum-exp per query head, and under GQA with more than one key/value head
    # per rank one more query-sized buffer; no s x s scores (measured: tests/plan/test_plan_memory.py)
    gqa = 1 if nq != nkv and nkv // tp > 1 else 0
    per_token = (3 * f + (5 + gqa) * dq + 5 * dkv + 2 * nq + nkv) // tp
    return e * (T * (6 * h + 2) // sp + T * per_token) + 4 * e * shape.seq_len * hd + extra


def backward_working_set(m, shape: Shape, tp: int, e: int, spec: str) -> int:
    """Gradients alive at once while one layer runs backward (besides the saved activations): in the
    attention, those of q, k, v and the residual (fused attention's backward needs no s x s tensor, on
    either spec); in the MLP, those of the SwiGLU input and output (of the routed rows in a MoE block)."""
    h, nq, nkv, hd = m.hidden_size, m.num_attention_heads, m.num_query_groups, m.head_dim
    T = shape.tokens
    if is_moe(m):
        mlp = moe_backward_working_set(m, T, tp, e) // e
    else:
        mlp = T * (4 * m.ffn_hidden_size // tp + h)
    if spec == "te":
        attn = T * ((3 * nq * hd + 2 * nkv * hd) // tp + h)
    else:
        attn = T * (3 * nq * hd // tp + h)
    return e * max(mlp, attn)


def stage_activations(cfg: MGRPOConfig, shape: Shape, stage: int, e: int, spec: str,
                      recompute: Optional[str]) -> int:
    """Activations stage `stage` holds at its peak of the 1F1B schedule."""
    m, a = cfg.model, cfg.actor
    layers = m.num_layers // a.pp
    per_layer = layer_activations(m, shape, a.tp, e, spec)
    if recompute == "full":  # each layer keeps its input; backward rebuilds one layer at a time
        per_mb = layers * e * shape.tokens * m.hidden_size
        peak_extra = per_layer
    else:
        per_mb, peak_extra = layers * per_layer, 0  # selective: fused attention keeps no s^2 to drop
    if stage == a.pp - 1:  # final norm: input, normalised and output (local) / input and output (TE)
        per_mb += e * shape.tokens * m.hidden_size * (3 if spec == "local" else 2)
    in_flight = max(min(a.pp - stage, shape.in_flight), 1)
    return in_flight * per_mb + peak_extra


def head_working_set(cfg: MGRPOConfig, shape: Shape, v_local: int, e: int, *, training: bool) -> int:
    """The log-prob head on the last stage (kernels/chunked.py, triton_kernel.py): `chunked` keeps a
    token chunk x local vocabulary fp32 logits plus a chunk x 8192 scratch tile; `fused` only tiles;
    `naive` the full [tokens, vocab/tp] fp32 logits (x3 with log-softmax and its gradient). Training also
    holds the fp32 dHidden and dWeight the fused loss computes in its forward, and the gathered hidden."""
    a, h = cfg.actor, cfg.model.hidden_size
    n = shape.response_tokens
    chunk = min(a.logprob_chunk_tokens(v_local), n)
    tile = chunk * min(8192, v_local) * 4
    if a.logprob_impl == "naive":
        logits = 3 * n * v_local * 4
    elif a.logprob_impl == "fused":
        logits = 2 * tile
    else:
        logits = (chunk * v_local * 4 if training else tile) + tile
    if not training:
        return logits + n * h * e
    return logits + n * h * (4 + e) + v_local * h * 4
