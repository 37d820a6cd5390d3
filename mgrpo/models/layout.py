"""HF <-> Megatron tensors under tensor parallelism: one TP rank's shard from HF tensors, and back.

Pure tensor bookkeeping: no files, no process groups. Which HF tensors make each Megatron parameter
is the model family's table (`ModelFamily.stage_weights`, e.g. qwen3.py); how each kind of parameter
is split across TP ranks is shapes.py. hf_checkpoint.py reads HF safetensors through `shard_from_hf`;
weight_iter.py gathers TP shards before `hf_from_shards`.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch

from mgrpo.models.shapes import (EXPERT_FC1, EXPERT_FC2, FC1, QKV, REPLICATED, ROUTER, ROW_PARALLEL, VOCAB, Dims,
                                 Weight, local_shape)


# read(hf_name, dim, start, stop) -> the slice [start, stop) of the HF tensor along dim
# (dim=None: the whole tensor). Lazy readers fetch only that slice from disk.
Reader = Callable[[str, Optional[int], int, int], torch.Tensor]


def shard_from_hf(w: Weight, read: Reader, d: Dims, tp_rank: int) -> torch.Tensor:
    """This TP rank's shard of Megatron weight `w`, read from HF tensors."""
    r, H = tp_rank, d.hidden
    if w.kind in (REPLICATED, ROUTER, EXPERT_FC2):  # whole on this rank (an expert on its EP rank)
        return read(w.hf[0], None, 0, 0)
    if w.kind == EXPERT_FC1:  # one expert's [gate; up], never split by TP
        return torch.cat([read(w.hf[0], None, 0, 0), read(w.hf[1], None, 0, 0)], dim=0)
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
    order, as `all_gather` into one buffer leaves them) or a list of shards. Replicated weights and
    experts (which TP does not split) take a single shard [1, *local_shape]. Results are views of
    `shards` where the layout allows (always at TP=1), otherwise one copy."""
    if not isinstance(shards, torch.Tensor):
        shards = torch.stack(list(shards))
    tp, H = shards.shape[0], d.hidden
    if w.kind in (REPLICATED, ROUTER, EXPERT_FC2):
        yield w.hf[0], shards[0]
    elif w.kind == EXPERT_FC1:  # [gate rows; up rows] of one expert
        yield w.hf[0], shards[0][: d.moe_ffn]
        yield w.hf[1], shards[0][d.moe_ffn:]
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
