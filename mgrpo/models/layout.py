"""Where each Qwen3 weight lives in Hugging Face and in Megatron-Core, and how TP shards it.

Pure tensor bookkeeping: no files, no process groups. `convert.py` reads HF safetensors through
`shard_from_hf` and gathers TP shards before `hf_from_shards`.

Megatron (one pipeline stage, layer j = local index, i = global index = layer_number - 1):

  embedding.word_embeddings.weight            <- model.embed_tokens.weight    rows split by TP, vocab padded
  decoder.layers.j.input_layernorm.weight     <- model.layers.i.input_layernorm.weight
      (TE spec: decoder.layers.j.self_attention.linear_qkv.layer_norm_weight)
  decoder.layers.j.self_attention.linear_qkv.weight <- q_proj, k_proj, v_proj fused per query group:
      for each group g: its heads/groups query heads, then k head g, then v head g; TP splits groups
  decoder.layers.j.self_attention.q_layernorm.weight <- model.layers.i.self_attn.q_norm.weight
  decoder.layers.j.self_attention.k_layernorm.weight <- model.layers.i.self_attn.k_norm.weight
  decoder.layers.j.self_attention.linear_proj.weight <- o_proj            columns split by TP
  decoder.layers.j.pre_mlp_layernorm.weight   <- model.layers.i.post_attention_layernorm.weight
      (TE spec: decoder.layers.j.mlp.linear_fc1.layer_norm_weight)
  decoder.layers.j.mlp.linear_fc1.weight      <- gate_proj, up_proj: each TP shard holds
                                                 [its gate rows; its up rows]
  decoder.layers.j.mlp.linear_fc2.weight      <- down_proj               columns split by TP
  decoder.final_layernorm.weight              <- model.norm.weight
  output_layer.weight                         <- lm_head.weight (untied), rows split by TP, vocab padded;
      tied with PP>1: the last stage's copy of model.embed_tokens.weight (loaded, never exported);
      tied with PP=1: absent (the output layer uses the embedding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from mgrpo.config import ModelConfig

REPLICATED = "replicated"  # same tensor on every TP rank
VOCAB = "vocab"  # rows split by TP, padded vocabulary rows are zero
ROW_PARALLEL = "row_parallel"  # input dimension (dim 1) split by TP
QKV = "qkv"
FC1 = "fc1"

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"
# Tensors some HF checkpoints carry that hold no weights (old rotary caches).
IGNORED_HF_SUFFIXES = (".rotary_emb.inv_freq",)


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

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int, vocab_padded: Optional[int] = None) -> "Dims":
        return cls(cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.num_query_groups,
                   cfg.head_dim, cfg.vocab_size, vocab_padded or cfg.vocab_size, tp)

    @property
    def heads_per_group(self) -> int:
        return self.heads // self.groups

    def check_tp(self) -> None:
        for what, n in (("num_query_groups", self.groups), ("ffn_hidden_size", self.ffn),
                        ("padded vocabulary", self.vocab_padded)):
            if n % self.tp:
                raise ValueError(f"tensor-parallel size {self.tp} does not divide model {what}={n}")
        if self.heads % self.groups:
            raise ValueError(f"num_query_groups={self.groups} does not divide num_attention_heads={self.heads}")
        if self.vocab_padded < self.vocab:
            raise ValueError(f"padded vocabulary {self.vocab_padded} is smaller than vocab_size={self.vocab}")


@dataclass(frozen=True)
class Weight:
    """One Megatron parameter of a stage and the HF tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    export: bool = True
    """False for the tied output-layer copy on the last stage (HF has only the embedding)."""


def hf_layer_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return dict(input_norm=p + "input_layernorm.weight", q=p + "self_attn.q_proj.weight",
                k=p + "self_attn.k_proj.weight", v=p + "self_attn.v_proj.weight",
                q_norm=p + "self_attn.q_norm.weight", k_norm=p + "self_attn.k_norm.weight",
                o=p + "self_attn.o_proj.weight", post_norm=p + "post_attention_layernorm.weight",
                gate=p + "mlp.gate_proj.weight", up=p + "mlp.up_proj.weight", down=p + "mlp.down_proj.weight")


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF Qwen3ForCausalLM checkpoint with its shape, in HF order."""
    h, f, hd = cfg.hidden_size, cfg.ffn_hidden_size, cfg.head_dim
    q_rows, kv_rows = cfg.num_attention_heads * hd, cfg.num_query_groups * hd
    out = {EMBED: (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        n = hf_layer_names(i)
        out.update({n["input_norm"]: (h,), n["q"]: (q_rows, h), n["k"]: (kv_rows, h), n["v"]: (kv_rows, h),
                    n["q_norm"]: (hd,), n["k_norm"]: (hd,), n["o"]: (h, q_rows), n["post_norm"]: (h,),
                    n["gate"]: (f, h), n["up"]: (f, h), n["down"]: (h, f)})
    out[FINAL_NORM] = (h,)
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = (cfg.vocab_size, h)
    return out


def _pick(param_names: Optional[set[str]], *candidates: str) -> str:
    """The first candidate the stage actually has (local vs TE spec key); the first if none."""
    if param_names is not None:
        for c in candidates:
            if c in param_names:
                return c
    return candidates[0]


def stage_weights(cfg: ModelConfig, *, layers: Sequence[int], pre_process: bool, post_process: bool,
                  param_names: Optional[set[str]] = None) -> list[Weight]:
    """The weights of one pipeline stage in export order (layers = global index of each local layer).

    `param_names` (the stage's parameter names) selects between the local-spec and TE-spec names
    of the fused layer norms.
    """
    out: list[Weight] = []
    if pre_process:
        out.append(Weight("embedding.word_embeddings.weight", (EMBED,), VOCAB))
    for j, i in enumerate(layers):
        m, n = f"decoder.layers.{j}.", hf_layer_names(i)
        out += [
            Weight(_pick(param_names, m + "input_layernorm.weight", m + "self_attention.linear_qkv.layer_norm_weight"),
                   (n["input_norm"],), REPLICATED),
            Weight(m + "self_attention.linear_qkv.weight", (n["q"], n["k"], n["v"]), QKV),
            Weight(m + "self_attention.q_layernorm.weight", (n["q_norm"],), REPLICATED),
            Weight(m + "self_attention.k_layernorm.weight", (n["k_norm"],), REPLICATED),
            Weight(m + "self_attention.linear_proj.weight", (n["o"],), ROW_PARALLEL),
            Weight(_pick(param_names, m + "pre_mlp_layernorm.weight", m + "mlp.linear_fc1.layer_norm_weight"),
                   (n["post_norm"],), REPLICATED),
            Weight(m + "mlp.linear_fc1.weight", (n["gate"], n["up"]), FC1),
            Weight(m + "mlp.linear_fc2.weight", (n["down"],), ROW_PARALLEL),
        ]
    if post_process:
        out.append(Weight("decoder.final_layernorm.weight", (FINAL_NORM,), REPLICATED))
        if not cfg.tie_word_embeddings:
            out.append(Weight("output_layer.weight", (LM_HEAD,), VOCAB))
        elif not pre_process:
            out.append(Weight("output_layer.weight", (EMBED,), VOCAB, export=False))
    return out


def megatron_name_of(cfg: ModelConfig) -> dict[str, str]:
    """HF name -> Megatron name (global layer numbering, local spec) for error messages."""
    out: dict[str, str] = {}
    for w in stage_weights(cfg, layers=range(cfg.num_layers), pre_process=True, post_process=True):
        for name in w.hf:
            out.setdefault(name, w.megatron)
    return out


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
    if "q_layernorm" in w.megatron or "k_layernorm" in w.megatron:
        return (d.head_dim,)
    return (d.hidden,)


# read(hf_name, dim, start, stop) -> the slice [start, stop) of the HF tensor along dim
# (dim=None: the whole tensor). Lazy readers fetch only that slice from disk.
Reader = Callable[[str, Optional[int], int, int], torch.Tensor]


def shard_from_hf(w: Weight, read: Reader, d: Dims, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of Megatron weight `w`, read from HF tensors."""
    r, H = tp_rank, d.hidden
    if w.kind == REPLICATED:
        return read(w.hf[0], None, 0, 0)
    if w.kind == ROW_PARALLEL:
        cols = local_shape(w, d)[1]
        return read(w.hf[0], 1, r * cols, (r + 1) * cols)
    if w.kind == VOCAB:
        rows = d.vocab_padded // d.tp
        start, stop = r * rows, min((r + 1) * rows, d.vocab)
        real = read(w.hf[0], 0, start, stop) if stop > start else None
        if real is not None and real.shape[0] == rows:
            return real
        out = torch.zeros(rows, H, dtype=real.dtype if real is not None else torch.float32)
        if real is not None:
            out[: real.shape[0]] = real
        return out
    if w.kind == QKV:
        gpr, hpg, hd = d.groups // d.tp, d.heads_per_group, d.head_dim
        g0 = r * gpr
        q = read(w.hf[0], 0, g0 * hpg * hd, (g0 + gpr) * hpg * hd).reshape(gpr, hpg * hd, H)
        k = read(w.hf[1], 0, g0 * hd, (g0 + gpr) * hd).reshape(gpr, hd, H)
        v = read(w.hf[2], 0, g0 * hd, (g0 + gpr) * hd).reshape(gpr, hd, H)
        return torch.cat([q, k, v], dim=1).reshape(-1, H)
    if w.kind == FC1:
        n = d.ffn // d.tp
        return torch.cat([read(w.hf[0], 0, r * n, (r + 1) * n), read(w.hf[1], 0, r * n, (r + 1) * n)], dim=0)
    raise ValueError(f"unknown weight kind {w.kind!r} of {w.megatron}")


def hf_from_shards(w: Weight, shards, d: Dims) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF tensors of `w` from its TP shards: a tensor [tp, *local_shape] (stacked in rank
    order, as `all_gather` into one buffer leaves them) or a list of shards. Results are views of
    `shards` where the layout allows (always at TP=1), otherwise one copy."""
    if not isinstance(shards, torch.Tensor):
        shards = torch.stack(list(shards))
    tp, H = shards.shape[0], d.hidden
    if w.kind == REPLICATED:
        yield w.hf[0], shards[0]
    elif w.kind == ROW_PARALLEL:  # [tp, H, cols/tp] -> [H, cols]
        yield w.hf[0], shards[0] if tp == 1 else shards.permute(1, 0, 2).reshape(H, -1)
    elif w.kind == VOCAB:
        yield w.hf[0], shards.reshape(-1, H)[: d.vocab]
    elif w.kind == QKV:
        hpg, hd = d.heads_per_group, d.head_dim
        full = shards.reshape(d.groups, hpg + 2, hd, H)  # TP shards hold consecutive query groups
        yield w.hf[0], full[:, :hpg].reshape(d.heads * hd, H)
        yield w.hf[1], full[:, hpg].reshape(d.groups * hd, H)
        yield w.hf[2], full[:, hpg + 1].reshape(d.groups * hd, H)
    elif w.kind == FC1:  # each shard is [gate rows; up rows]
        halves = shards.reshape(tp, 2, d.ffn // tp, H)
        for k, name in enumerate(w.hf):
            yield name, halves[:, k].reshape(d.ffn, H)
    else:
        raise ValueError(f"unknown weight kind {w.kind!r} of {w.megatron}")
