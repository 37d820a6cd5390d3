"""Core attention for THD-packed and context-parallel batches where Transformer Engine cannot run.

On a GPU, Transformer Engine's attention takes packed sequences (`PackedSeqParams`, qkv_format
'thd') and context parallelism (its ring / all-gather exchange over the CP group). megatron's own
local `DotProductAttention` does neither: it refuses `packed_seq_params` and asserts CP == 1. This
module is the exact stand-in that the local layer spec gets instead, so the CPU runs (tests, CI, the
default job) train on the same batches as the GPU. It is a reference, written to be read, like the
log-prob kernel's reference twin: per sequence, softmax(q k^T * scale + causal mask) v.

The layout it expects is the one megatron and TE use (and `mgrpo.training.batch` builds):
  - THD: the sequences of a micro-batch laid end to end; sequence i occupies
    `cu_seqlens_q_padded[i+1] - cu_seqlens_q_padded[i]` slots (its real length rounded up; padding at
    its end, so causality already keeps real tokens from seeing it).
  - padded [s, b]: every row one sequence.
  - context parallelism (cp > 1): each sequence of global length L (a multiple of 2*cp) is cut into
    2*cp chunks and CP rank r holds chunks r and 2*cp-1-r (`cp_positions`), which balances the
    causal work. A rank attends its queries against the whole sequence's keys and values: they are
    all-gathered over the CP group (backward: the gradient is summed over the group and each rank
    keeps its own slice), and the causal mask compares global positions.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

from mgrpo.models.attention_layout import cp_positions, global_order


class _AllGather(torch.autograd.Function):
    """[t, ...] on each CP rank -> [cp, t, ...] on every rank. Backward: every rank's gradient of the
    gathered tensor is summed over the group (all-reduce; gloo has no reduce-scatter) and each rank
    keeps its own slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group.size())]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.group.rank()], None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Sequences of one length, batched: queries [n, l, heads, d] at global positions `q_pos` [l]
    against their keys and values [n, L, groups, d] in position order; a query sees the keys at
    positions <= its own."""
    heads, groups = q.shape[2], k.shape[2]
    if heads != groups:  # grouped-query attention: query head h reads key/value group h // (heads/groups)
        k = k.repeat_interleave(heads // groups, dim=2)
        v = v.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos.to(q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("nhqk,nkhd->nqhd", probs, v)


class ReferenceCoreAttention(MegatronModule):
    """Drop-in for megatron's `core_attention` submodule (same constructor and forward arguments)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        from megatron.core.transformer.enums import AttnMaskType

        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        unsupported = {
            "attn_mask_type": attn_mask_type != AttnMaskType.causal,
            "attention_dropout": dropout != 0.0,
            "softmax_type": config.softmax_type != "vanilla",
            "window_size": config.window_size is not None,
        }
        if any(unsupported.values()):
            raise ValueError(f"ReferenceCoreAttention supports causal attention without dropout, sinks or windows; "
                             f"got {[k for k, v in unsupported.items() if v]}")
        if pg_collection is None or getattr(pg_collection, "cp", None) is None:
            raise ValueError("ReferenceCoreAttention needs pg_collection with the tp and cp groups")
        self.cp_group = pg_collection.cp
        # megatron's softmax scale (apply_query_key_layer_scaling divides the scale by the layer number
        # and multiplies the scores back inside the softmax: the same value in fp32)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("ReferenceCoreAttention takes no attention_bias")
        cp = self.cp_group.size()
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"packed qkv_format={packed_seq_params.qkv_format!r}; only 'thd' is packed")
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            out = self._attend(query, key, value, torch.diff(cu).tolist(), cp)  # [t, heads, d]
            return out.reshape(out.shape[0], -1)
        s, b = query.shape[:2]  # [s, b, heads, d]: every row one sequence of global length s * cp
        rows = lambda x: x.transpose(0, 1).reshape(b * s, *x.shape[2:])  # noqa: E731
        out = self._attend(rows(query), rows(key), rows(value), [s * cp] * b, cp)
        return out.reshape(b, s, -1).transpose(0, 1).contiguous()

    def _attend(self, q, k, v, seq_lens: list[int], cp: int) -> torch.Tensor:
        """q, k, v: this rank's tokens [t, heads or groups, d], sequence after sequence (each holding
        its CP share); `seq_lens` are the global lengths."""
        if sum(seq_lens) != cp * q.shape[0]:
            raise ValueError(f"{q.shape[0]} tokens on this rank, but the sequence lengths {seq_lens} over "
                             f"cp={cp} ranks give {sum(seq_lens) // cp}")
        if cp > 1:
            order = global_order(seq_lens, cp).to(q.device)
            k = _AllGather.apply(k, self.cp_group).flatten(0, 1)[order]
            v = _AllGather.apply(v, self.cp_group).flatten(0, 1)[order]
        rank = self.cp_group.rank()
        # sequences of equal length share their positions and mask: one batched call per length
        # (the default job's many short samples would otherwise cost one call each)
        local_start = torch.tensor([0] + seq_lens[:-1]).cumsum(0) // cp
        glob_start = torch.tensor([0] + seq_lens[:-1]).cumsum(0)
        by_length: dict[int, list[int]] = {}
        for i, length in enumerate(seq_lens):
            by_length.setdefault(length, []).append(i)
        outs, where = [], []
        for length, seqs in by_length.items():
            pos = cp_positions(length, cp, rank)
            q_idx = (local_start[seqs][:, None] + torch.arange(pos.numel())[None, :]).to(q.device)
            k_idx = (glob_start[seqs][:, None] + torch.arange(length)[None, :]).to(q.device)
            outs.append(causal_attention(q[q_idx], k[k_idx], v[k_idx], pos, self.scale).flatten(0, 1))
            where.append(q_idx.flatten())
        out = torch.cat(outs)
        return out[torch.argsort(torch.cat(where))]  # back to this rank's token order
