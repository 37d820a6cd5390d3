"""Core attention for THD-packed and context-parallel batches where Transformer Engine cannot run.

On a GPU, Transformer Engine's attention takes packed sequences (`PackedSeqParams`, qkv_format
'thd') and context parallelism (its ring / all-gather exchange over the CP group). megatron's own
local `DotProductAttention` does neither: it refuses `packed_seq_params` and asserts CP == 1. This
module is the exact stand-in that the local layer spec gets instead, so the CPU runs (tests, CI, the
default job) train on the same batches as the GPU. Per sequence it computes
softmax(q k^T * scale + causal mask) v: `causal_attention_reference` says so in einsums, written to be
read (the tests compare against it); the layer runs the same through torch's fused attention
(`causal_attention`), one call per bucket of similar-length sequences padded to the bucket's longest,
with the index tensors of a layout built once and shared by every layer (`_plan`).

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

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule


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


def causal_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """The definition, written to be read (the tests compare `causal_attention` with it): sequences of
    one length, batched: queries [n, l, heads, d] at global positions `q_pos` [l] against their keys
    and values [n, L, groups, d] in position order; a query sees the keys at positions <= its own."""
    heads, groups = q.shape[2], k.shape[2]
    if heads != groups:  # grouped-query attention: query head h reads key/value group h // (heads/groups)
        k = k.repeat_interleave(heads // groups, dim=2)
        v = v.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] <= q_pos.to(q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return torch.einsum("nhqk,nkhd->nqhd", probs, v)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: Optional[torch.Tensor],
                     scale: float) -> torch.Tensor:
    """The same through torch's fused attention (on CPU its flash kernel: ~2x the einsum version's
    speed, no [n, heads, l, L] score tensors kept for backward). q [n, l, heads, d]; k, v [n, L, groups, d];
    `visible` [n, 1, l, L] (which keys each query sees), or None: query slot i sees key slots <= i."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=visible, is_causal=visible is None,
        scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    return out.transpose(1, 2)


@dataclass(frozen=True)
class _Bucket:
    """Sequences padded to one length for one fused-attention call. Pad slots repeat a real row of
    their sequence: a pad key sits after every real query of its sequence (masked by causality) and
    a pad query's output is never read, so neither changes a value or a gradient."""
    q_idx: Optional[torch.Tensor]  # [n, l] rows of this rank's q; None: all of q in order, as [n, l]
    k_idx: Optional[torch.Tensor]  # [n, L] rows of the keys (cp > 1: of the all-gathered [cp * t] buffer)
    visible: Optional[torch.Tensor]  # [n, 1, l, L] (cp > 1: global positions); None: causal from slot 0
    shape: tuple[int, int]  # (n, l)


@dataclass(frozen=True)
class _Plan:
    buckets: tuple[_Bucket, ...]
    out_idx: Optional[torch.Tensor]  # [t]: each token's row in the buckets' concatenated outputs; None: same order


def buckets_by_length(seq_lens: Sequence[int], waste: float = 1.5) -> list[list[int]]:
    """Sequence indices grouped for padded batched calls: longest first, a sequence joins the current
    group while the group's padded attention work (n * longest^2) stays within `waste` times its real
    work (sum of length^2). Many short samples of similar lengths make one call; lengths far apart
    stay apart (no small sequence is padded to a long one). Empty sequences are left out."""
    groups: list[list[int]] = []
    real = 0
    for i in sorted((i for i, n in enumerate(seq_lens) if n), key=lambda i: -seq_lens[i]):
        if groups and (len(groups[-1]) + 1) * seq_lens[groups[-1][0]] ** 2 <= waste * (real + seq_lens[i] ** 2):
            groups[-1].append(i)
            real += seq_lens[i] ** 2
        else:
            groups.append([i])
            real = seq_lens[i] ** 2
    return groups


@functools.lru_cache(maxsize=8)
def _plan(seq_lens: tuple[int, ...], cp: int, rank: int, device: str) -> _Plan:
    """Index tensors for one layout, built once and shared by every layer (and by repeated forwards
    of the same micro-batch)."""
    lens = torch.tensor(seq_lens, dtype=torch.long)
    local = lens // cp  # this rank's tokens of each sequence
    q_start = torch.cumsum(local, 0) - local
    t = int(local.sum())
    out_idx = torch.empty(t, dtype=torch.long)
    buckets, offset = [], 0
    for seqs in buckets_by_length(seq_lens):
        s = torch.tensor(seqs)
        n, big = len(seqs), seq_lens[seqs[0]]
        slot_q, slot_k = torch.arange(big // cp), torch.arange(big)
        real = slot_q[None, :] < local[s][:, None]  # [n, l]
        q_idx = q_start[s][:, None] + torch.where(real, slot_q, 0)
        k_pos = torch.where(slot_k[None, :] < lens[s][:, None], slot_k, 0)  # [n, L] (pad slots: position 0)
        k_idx = q_start[s][:, None] + k_pos  # cp == 1: this rank's rows
        visible = None
        if cp > 1:
            # sequence i's chunk length c: rank r holds chunks r and 2cp-1-r (mgrpo.models.attention_layout),
            # its local slot j < c at position r*c + j, slot j >= c at (2cp-1-r)*c + j - c
            c = (lens[s] // (2 * cp))[:, None]
            chunk = k_pos // c  # the key at global position p: in chunk p // c, on rank `owner`
            owner = torch.where(chunk < cp, chunk, 2 * cp - 1 - chunk)
            k_idx = owner * t + q_start[s][:, None] + torch.where(chunk < cp, 0, c) + k_pos % c
            q_pos = torch.where(slot_q < c, rank * c + slot_q, (2 * cp - 2 - rank) * c + slot_q)
            q_pos = torch.where(real, q_pos, 0)
            visible = (slot_k[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)
        out_idx[q_idx[real]] = offset + torch.arange(n * slot_q.numel()).view(n, -1)[real]
        offset += n * slot_q.numel()
        in_order = cp == 1 and len(seqs) * big == t and torch.equal(q_idx.flatten(), torch.arange(t))
        to = lambda x: None if x is None else x.to(device)  # noqa: E731
        buckets.append(_Bucket(None if in_order else to(q_idx), None if in_order else to(k_idx), to(visible),
                               (n, slot_q.numel())))
    identity = offset == t and torch.equal(out_idx, torch.arange(t))
    return _Plan(tuple(buckets), None if identity else out_idx.to(device))


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
        plan = _plan(tuple(seq_lens), cp, self.cp_group.rank(), str(q.device))
        if cp > 1:
            k = _AllGather.apply(k, self.cp_group).flatten(0, 1)
            v = _AllGather.apply(v, self.cp_group).flatten(0, 1)
        outs = []
        for b in plan.buckets:
            if b.q_idx is None:  # one bucket of whole sequences in order (padded rows, equal lengths)
                qb, kb, vb = (x.reshape(*b.shape, *x.shape[1:]) for x in (q, k, v))
            else:
                qb, kb, vb = q[b.q_idx], k[b.k_idx], v[b.k_idx]
            outs.append(causal_attention(qb, kb, vb, b.visible, self.scale).flatten(0, 1))
        if not outs:  # only empty sequences
            return q.new_zeros(0, q.shape[1], v.shape[2])
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out if plan.out_idx is None else out[plan.out_idx]  # back to this rank's token order
