"""LoRA in the memory plan: the adapters' parameters on one rank of each pipeline stage (no torch).

With actor.lora the base is frozen in the training dtype (no gradient buffer, no optimizer state, no fp32
master), the adapters carry the fp32 gradient buffer and Adam's states, and there is no reference copy (the
reference is the base with the adapters off). Each adapted linear of in x out features adds A [r, in] and
B [out, r]; a column-parallel linear (qkv, fc1) splits B over TP and keeps A whole, a row-parallel one
(proj, fc2) splits A and keeps B whole; experts are whole on their expert-parallel rank (expert TP 1).
"""

from __future__ import annotations

from mgrpo.config.lora import EXPERTS, parse_targets


def adapter_counts(m, lora, tp: int, pp: int, ep: int = 1) -> tuple[list[int], list[int]]:
    """(adapter parameters per rank of each stage, of which in experts); zeros without actor.lora."""
    if not lora.enabled:
        return [0] * pp, [0] * pp
    r = int(lora.rank)
    t = parse_targets(lora.target_modules, num_experts=m.num_experts).linears
    h, q = m.hidden_size, m.num_attention_heads * m.head_dim
    kv = 2 * m.num_query_groups * m.head_dim

    def column(i, o):
        return r * i + o // tp * r

    def row(i, o):
        return r * i // tp + o * r

    dense = 0
    if "linear_qkv" in t:
        dense += column(h, q + kv)
    if "linear_proj" in t:
        dense += row(q, h)
    expert = 0
    if m.num_experts:
        f = m.moe_ffn_hidden_size
        per = (r * h + 2 * f * r if ("linear_fc1" in t or EXPERTS in t) else 0) + \
              (r * f + h * r if ("linear_fc2" in t or EXPERTS in t) else 0)
        expert = per * (m.num_experts // ep)
    else:
        f = m.ffn_hidden_size
        if "linear_fc1" in t:
            dense += column(h, 2 * f)
        if "linear_fc2" in t:
            dense += row(f, h)
    layers = m.num_layers // pp
    return [layers * (dense + expert)] * pp, [layers * expert] * pp
