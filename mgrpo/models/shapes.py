"""Sizes of a Megatron GPT model, without torch: padded vocabulary, per-rank tensor shapes, parameter counts.

The one home of these rules for the trainer, the converter and the planner (which must not import
torch). Names of the kinds follow how megatron-core shards a GPT under tensor parallelism (TP):

  REPLICATED    the same tensor on every TP rank (norms)
  VOCAB         rows split by TP over the padded vocabulary; padded rows are zero
  ROW_PARALLEL  input dimension (dim 1) split by TP (attention output, MLP down projection)
  QKV           fused query/key/value rows, split by query group
  FC1           fused SwiGLU gate and up rows; each TP shard holds [its gate rows; its up rows]

and how it places a mixture-of-experts layer (expert tensor parallelism 1: an expert is never split):

  ROUTER        the router's [experts, hidden] weight, whole on every rank
  EXPERT_FC1    one expert's fused [gate rows; up rows], whole, on the expert-parallel rank that owns it
  EXPERT_FC2    one expert's down projection, whole, on that rank
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

REPLICATED = "replicated"
VOCAB = "vocab"
ROW_PARALLEL = "row_parallel"
QKV = "qkv"
FC1 = "fc1"
ROUTER = "router"
EXPERT_FC1 = "expert_fc1"
EXPERT_FC2 = "expert_fc2"
EXPERT_KINDS = (EXPERT_FC1, EXPERT_FC2)


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron shards the embedding and output layer by rows; pad so every TP shard is equal
    (megatron's own rule: a multiple of make_vocab_size_divisible_by * tp)."""
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


@dataclass(frozen=True)
class Weight:
    """One Megatron parameter of a stage and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    export: bool = True
    """False for the tied output-layer copy on the last stage (HF has only the embedding)."""


@dataclass(frozen=True)
class Dims:
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    vocab_padded: int
    tp: int
    experts: int = 0
    """Routed experts per layer (0: dense MLP layers)."""
    moe_ffn: int = 0

    @classmethod
    def of(cls, cfg, tp: int, vocab_padded: Optional[int] = None) -> "Dims":
        """From a ModelConfig at tensor-parallel size `tp`."""
        return cls(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
                   cfg.head_dim, cfg.vocab_size, vocab_padded or cfg.vocab_size, tp,
                   getattr(cfg, "num_experts", 0), getattr(cfg, "moe_ffn_hidden_size", 0))

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    def check_tp(self) -> None:
        # A MoE model has no dense MLP to split (its ffn_hidden_size only travels with config.json), and
        # its experts are whole on their rank.
        split = (("num_query_groups", self.groups), ("padded vocabulary", self.vocab_padded))
        for what, n in split + ((("ffn_hidden_size", self.ffn),) if not self.experts else ()):
            if n % self.tp:
                raise ValueError(f"tensor-parallel size {self.tp} does not divide model {what}={n}")
        if self.heads % self.groups:
            raise ValueError(f"num_query_groups={self.groups} does not divide num_attention_heads={self.heads}")
        if self.vocab_padded < self.vocab:
            raise ValueError(f"padded vocabulary {self.vocab_padded} is smaller than vocab_size={self.vocab}")


def local_shape(w: Weight, d: Dims) -> tuple[int, ...]:
    """Shape of `w` on one TP rank."""
    if w.kind == VOCAB:
        return (d.vocab_padded // d.tp, d.hidden)
    if w.kind == QKV:
        return (d.groups // d.tp * (d.heads_per_group + 2) * d.head_dim, d.hidden)
    if w.kind == FC1:
        return (2 * d.ffn // d.tp, d.hidden)
    if w.kind == ROW_PARALLEL:
        cols = d.heads * d.head_dim if "linear_proj" in w.megatron else d.ffn
        return (d.hidden, cols // d.tp)
    if w.kind == ROUTER:
        return (d.experts, d.hidden)
    if w.kind == EXPERT_FC1:
        return (2 * d.moe_ffn, d.hidden)
    if w.kind == EXPERT_FC2:
        return (d.hidden, d.moe_ffn)
    if "q_layernorm" in w.megatron or "k_layernorm" in w.megatron:
        return (d.head_dim,)
    return (d.hidden,)


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer by part: `sharded` parts are split tp ways, `replicated`
    parts (norms, a router) are whole on every TP rank, `expert` parts (routed experts) are split ep
    ways and never by TP."""

    sharded: dict[str, int]
    replicated: dict[str, int]
    expert: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.sharded.values()) + sum(self.replicated.values()) + sum(self.expert.values())

    def per_rank(self, tp: int, ep: int = 1) -> int:
        return sum(self.sharded.values()) // tp + sum(self.replicated.values()) + self.expert_per_rank(ep)

    def expert_per_rank(self, ep: int = 1) -> int:
        return sum(self.expert.values()) // ep


def gpt_param_counts(layer: LayerParams, *, vocab_size: int, hidden_size: int, num_layers: int,
                     tie_word_embeddings: bool, vocab_divisible_by: int, tp: int = 1, pp: int = 1,
                     ep: int = 1) -> dict:
    """Whole-model counts (HF layout and megatron's padded layout) and the count each rank holds.

    A rank of pipeline stage s holds num_layers/pp layers with the matrices split tp ways, the
    norms replicated and 1/ep of the experts; stage 0 adds its vocab/tp rows of the embedding, the last
    stage the final norm and the output layer (a copy of the embedding when tied and pp > 1, as megatron
    keeps one there). `expert_per_rank_by_stage` is the experts' share of each stage's count."""
    v_pad = padded_vocab_size(vocab_size, tp, vocab_divisible_by)
    h = hidden_size
    heads = 1 if tie_word_embeddings else 2
    stages = []
    for s in range(pp):
        first, last = s == 0, s == pp - 1
        n = num_layers // pp * layer.per_rank(tp, ep)
        if first:
            n += v_pad // tp * h
        if last:
            n += h  # final norm
            if not tie_word_embeddings or pp > 1:
                n += v_pad // tp * h
        stages.append(n)
    return {
        "per_layer": {**layer.sharded, **layer.replicated, **layer.expert},
        "layer": layer.total,
        "hf_total": heads * vocab_size * h + num_layers * layer.total + h,
        "megatron_total": heads * v_pad * h + num_layers * layer.total + h,
        "padded_vocab": v_pad,
        "per_rank_by_stage": stages,
        "expert_per_rank_by_stage": [num_layers // pp * layer.expert_per_rank(ep)] * pp,
        "expert_total": num_layers * sum(layer.expert.values()),
    }
