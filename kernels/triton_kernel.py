"""Triton kernels for the fused log-prob / entropy / token-loss path (impl="fused").

Imported only by `mgrpo_kernels.__init__` after a capability check (CUDA + triton, or
TRITON_INTERPRET=1 on CPU), so `import mgrpo_kernels` never needs triton.

Forward: each program owns BT tokens and one split of the vocabulary, streams BV-row blocks of the
weight with an online log-sum-exp and writes fp32 partial stats (m, s, t, target) per token; splits
(and then tensor-parallel ranks) are merged by the same `merge_stats` as the chunked path. Logits
exist only as one [BT, BV] register tile.
Backward: each program recomputes one [BT, BV] logit tile from hidden and weight plus the per-token
lse, forms dL/dlogits in registers and atomically adds its share of dHidden = dz @ W and
dWeight = dz^T @ h into fp32 buffers (the Cut-Cross-Entropy layout: no [T, V] tensor, no second
pass over tokens or vocabulary).

Sampling supports (support.py): token chunk by token chunk, the kernels take the chunk's column space
(COLS: the weight rows of its support union, gathered by index) and its [chunk x columns] membership
(MEMBER, uint8); a column outside a token's support gets the logit NEG in the stats and dz = 0 in the
gradient. Without supports nothing changes: one launch over all tokens and contiguous rows.

Left out on purpose: autotuning (one config per device class; this project has no GPU in CI to
tune on) and a persistent schedule; per-call block sizes are in `_blocks`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .chunked import coefficients, merge_stats, num_valid_rows, scale_coefficients, unscale_for_backward
from .support import NEG, ChunkColumns, all_columns, chunk_columns

NEG_LOGIT = tl.constexpr(NEG)  # a global read inside @triton.jit must be a constexpr


@triton.jit
def _logit_tile(H, W, offs_t, w_rows, tmask, vmask, hdim, stride_h, stride_w,
                BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """fp32 tile hidden[offs_t] @ weight[w_rows].T, accumulated over the hidden dimension in BK steps:
    the only place logits exist, one [BT, BV] tile at a time (both kernels recompute it)."""
    acc = tl.zeros([BT, BV], tl.float32)
    for k0 in range(0, hdim, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < hdim
        h = tl.load(H + offs_t[:, None] * stride_h + offs_k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + w_rows[:, None] * stride_w + offs_k[None, :], mask=vmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PREC)
    return acc


@triton.jit
def _weight_rows(COLS, offs_v, vmask, HAS_COLS: tl.constexpr):
    """The weight rows of column positions offs_v: gathered (a support union) or the positions themselves."""
    if HAS_COLS:
        return tl.load(COLS + offs_v, mask=vmask, other=0)
    return offs_v


@triton.jit
def _in_support(MEMBER, offs_t, offs_v, tmask, vmask, n_cols):
    """[BT, BV] membership of the tile's columns in each token's support (uint8 [tokens, n_cols] in memory)."""
    return tl.load(MEMBER + offs_t[:, None] * n_cols + offs_v[None, :], mask=tmask[:, None] & vmask[None, :],
                   other=0) != 0


@triton.jit
def _stats_kernel(H, W, LAB, COLS, MEMBER, M, S, TT, TGT, n_tok, hdim, split, n_valid, inv_temp,
                  stride_h, stride_w,
                  BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                  ENTROPY: tl.constexpr, PREC: tl.constexpr, HAS_COLS: tl.constexpr, HAS_MEMBER: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT).to(tl.int64)  # int64: V * H can exceed 2^31 elements
    tmask = offs_t < n_tok
    lab = tl.load(LAB + offs_t, mask=tmask, other=-1)  # the label's column position
    m = tl.full([BT], float("-inf"), tl.float32)
    s = tl.zeros([BT], tl.float32)
    t = tl.zeros([BT], tl.float32)
    tgt = tl.zeros([BT], tl.float32)
    v_lo = pid_s * split
    v_hi = tl.minimum(v_lo + split, n_valid)
    for v0 in range(v_lo, v_hi, BV):
        offs_v = v0 + tl.arange(0, BV).to(tl.int64)
        vmask = offs_v < v_hi
        w_rows = _weight_rows(COLS, offs_v, vmask, HAS_COLS)
        z = _logit_tile(H, W, offs_t, w_rows, tmask, vmask, hdim, stride_h, stride_w, BT, BV, BK, PREC) * inv_temp
        if HAS_MEMBER:
            z = tl.where(_in_support(MEMBER, offs_t, offs_v, tmask, vmask, n_valid), z, NEG_LOGIT)
        z = tl.where(vmask[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))  # finite: every block has at least one valid column
        e = tl.exp(z - m_new[:, None])
        rescale = tl.exp(m - m_new)
        s = s * rescale + tl.sum(e, 1)
        if ENTROPY:
            t = t * rescale + tl.sum(e * tl.where(vmask[None, :], z, 0.0), 1)
        m = m_new
        tgt += tl.sum(tl.where(offs_v[None, :] == lab[:, None], z, 0.0), 1)
    out = pid_s * n_tok + offs_t
    tl.store(M + out, m, mask=tmask)
    tl.store(S + out, s, mask=tmask)
    tl.store(TT + out, t, mask=tmask)
    tl.store(TGT + out, tgt, mask=tmask)


@triton.jit
def _grad_kernel(H, W, LAB, COLS, MEMBER, LSE, A, B, G, DH, DW, n_tok, hdim, n_valid, inv_temp,
                 stride_h, stride_w,
                 BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                 NEED_DH: tl.constexpr, NEED_DW: tl.constexpr, PREC: tl.constexpr,
                 HAS_COLS: tl.constexpr, HAS_MEMBER: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT).to(tl.int64)
    offs_v = pid_v * BV + tl.arange(0, BV).to(tl.int64)
    tmask = offs_t < n_tok
    vmask = offs_v < n_valid
    w_rows = _weight_rows(COLS, offs_v, vmask, HAS_COLS)
    z = _logit_tile(H, W, offs_t, w_rows, tmask, vmask, hdim, stride_h, stride_w, BT, BV, BK, PREC) * inv_temp
    lse = tl.load(LSE + offs_t, mask=tmask, other=0.0)
    a = tl.load(A + offs_t, mask=tmask, other=0.0)
    b = tl.load(B + offs_t, mask=tmask, other=0.0)
    g = tl.load(G + offs_t, mask=tmask, other=0.0)
    lab = tl.load(LAB + offs_t, mask=tmask, other=-1)
    # Same algebra as chunked.tile_dlogits: dz = p * (a + b z) + g * onehot(label), 1/T folded in;
    # outside a token's support dz = 0.
    p = tl.exp(z - lse[:, None])
    dz = p * (a[:, None] + b[:, None] * z) + tl.where(offs_v[None, :] == lab[:, None], g[:, None], 0.0)
    keep = tmask[:, None] & vmask[None, :]
    if HAS_MEMBER:
        keep = keep & _in_support(MEMBER, offs_t, offs_v, tmask, vmask, n_valid)
    dz = tl.where(keep, dz, 0.0).to(H.dtype.element_ty)
    for k0 in range(0, hdim, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < hdim
        if NEED_DH:
            w = tl.load(W + w_rows[:, None] * stride_w + offs_k[None, :], mask=vmask[:, None] & kmask[None, :],
                        other=0.0)
            tl.atomic_add(DH + offs_t[:, None] * hdim + offs_k[None, :], tl.dot(dz, w, input_precision=PREC),
                          mask=tmask[:, None] & kmask[None, :])
        if NEED_DW:
            h = tl.load(H + offs_t[:, None] * stride_h + offs_k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
            tl.atomic_add(DW + w_rows[:, None] * hdim + offs_k[None, :], tl.dot(tl.trans(dz), h, input_precision=PREC),
                          mask=vmask[:, None] & kmask[None, :])


def _blocks(device):
    if device.type != "cuda":  # TRITON_INTERPRET=1 on CPU: tiny tiles keep the interpreter fast
        return dict(BT=16, BV=16, BK=16), 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return dict(BT=64, BV=128, BK=64), sms


def triton_stats(hidden, weight, plan: ChunkColumns, inv_temp, entropy, group):
    """Per-token (lse, E_p[z], target logit) in fp32 over the columns of `plan`; splits merged here, TP
    ranks by merge_stats."""
    n_tok, hdim = hidden.shape
    n_valid = plan.n_cols
    if n_tok == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty, empty
    blk, sms = _blocks(hidden.device)
    t_blocks = triton.cdiv(n_tok, blk["BT"])
    v_blocks = max(1, triton.cdiv(n_valid, blk["BV"]))
    n_splits = max(1, min(v_blocks, triton.cdiv(2 * sms, t_blocks)))  # enough programs to fill the device
    split = triton.cdiv(v_blocks, n_splits) * blk["BV"]
    n_splits = max(1, triton.cdiv(n_valid, split))
    part = torch.empty(4, n_splits, n_tok, device=hidden.device, dtype=torch.float32)
    prec = "ieee" if hidden.dtype == torch.float32 else "tf32"
    cols, member = _support_args(plan, part)
    _stats_kernel[(t_blocks, n_splits)](
        hidden, weight, plan.label_col.contiguous(), cols, member, part[0], part[1], part[2], part[3], n_tok, hdim,
        split, n_valid, inv_temp, hidden.stride(0), weight.stride(0), ENTROPY=entropy, PREC=prec,
        HAS_COLS=plan.cols is not None, HAS_MEMBER=plan.membership is not None, **blk)
    m, s, t, tgt = part.unbind(0)  # a shard of padding only keeps m = -inf, s = t = 0
    m_max = m.amax(0)
    scale = torch.where(torch.isinf(m), 0.0, torch.exp(m - m_max))
    return merge_stats(m_max, (s * scale).sum(0), (t * scale).sum(0), tgt.sum(0), group=group)


def _support_args(plan: ChunkColumns, dummy):
    """The COLS and MEMBER buffers of a launch (`dummy`, a valid pointer never read, where absent)."""
    cols = dummy if plan.cols is None else plan.cols.contiguous()
    return cols, dummy if plan.membership is None else plan.membership.view(torch.uint8)


def triton_grads(hidden, weight, plan: ChunkColumns, inv_temp, lse, coeffs, dh, dw):
    """Add this chunk's dHidden into `dh` ([chunk, H] fp32) and dWeight into `dw` ([V_local, H] fp32)."""
    n_tok, hdim = hidden.shape
    a, b, g = coeffs
    b = torch.zeros_like(a) if b is None else b
    blk, _ = _blocks(hidden.device)
    if plan.n_cols > 0 and n_tok > 0:
        grid = (triton.cdiv(n_tok, blk["BT"]), triton.cdiv(plan.n_cols, blk["BV"]))
        dummy = a  # a valid pointer for a buffer the kernel is told not to touch
        cols, member = _support_args(plan, dummy)
        _grad_kernel[grid](
            hidden, weight, plan.label_col.contiguous(), cols, member, lse.contiguous(), a.contiguous(),
            b.contiguous(), g.contiguous(), dummy if dh is None else dh, dummy if dw is None else dw, n_tok, hdim,
            plan.n_cols, inv_temp, hidden.stride(0), weight.stride(0), NEED_DH=dh is not None,
            NEED_DW=dw is not None, PREC="ieee" if hidden.dtype == torch.float32 else "tf32",
            HAS_COLS=plan.cols is not None, HAS_MEMBER=plan.membership is not None, **blk)


def _prepare(hidden, weight, labels, cfg):
    n_valid = num_valid_rows(weight.shape[0], cfg["vocab_start"], cfg["vocab_size"])
    labels_local = (labels.long() - cfg["vocab_start"]).contiguous()
    return hidden.contiguous(), weight.contiguous(), labels_local, n_valid, 1.0 / cfg["temperature"]


def _column_chunks(n_tok, labels_local, n_valid, cfg):
    """Yields (token slice, its ChunkColumns): all tokens in one launch without supports; with them
    cfg['chunk_size'] tokens at a time, one chunk's membership ([chunk x columns]) alive at a time."""
    if cfg["support"] is None:
        yield slice(0, n_tok), all_columns(n_valid, labels_local)
        return
    step = max(1, cfg["chunk_size"])
    for a in range(0, n_tok, step):
        sl = slice(a, min(a + step, n_tok))
        yield sl, chunk_columns(*cfg["support"], sl, labels_local[sl], cfg["vocab_start"], n_valid)


def _stats(hidden, weight, labels_local, n_valid, inv_temp, cfg):
    """(lse, E_p[z], target) of every token, chunk by chunk (see _column_chunks)."""
    out = [torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32) for _ in range(3)]
    for sl, plan in _column_chunks(hidden.shape[0], labels_local, n_valid, cfg):
        for dest, x in zip(out, triton_stats(hidden[sl], weight, plan, inv_temp, cfg["compute_entropy"],
                                             cfg["tp_group"])):
            dest[sl] = x
    return out


def _grads(hidden, weight, labels_local, n_valid, inv_temp, lse, coeffs, need_h, need_w, cfg, into=None):
    """`into`: the caller's fp32 buffer dWeight is added to (fused_linear_loss's grad_weight_into)."""
    dh = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_h else None
    dw = (into if into is not None else torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)) \
        if need_w else None
    for sl, plan in _column_chunks(hidden.shape[0], labels_local, n_valid, cfg):
        part = tuple(None if c is None else c[sl] for c in coeffs)
        triton_grads(hidden[sl], weight, plan, inv_temp, lse[sl], part, None if dh is None else dh[sl], dw)
    return _allreduce_(dh, cfg["tp_group"]), dw  # hidden is replicated over the TP group


def _allreduce_(x, group):
    if x is not None and group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(x, group=group)
    return x


class TritonLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, cfg):
        hidden, weight, labels_local, n_valid, inv_temp = _prepare(hidden, weight, labels, cfg)
        lse, e_z, tgt = _stats(hidden, weight, labels_local, n_valid, inv_temp, cfg)
        ctx.save_for_backward(hidden, weight, labels_local, lse, e_z)
        ctx.cfg, ctx.n_valid = cfg, n_valid
        ctx.set_materialize_grads(False)
        return tgt - lse, (lse - e_z if cfg["compute_entropy"] else None)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels_local, lse, e_z = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None
        inv_temp = 1.0 / ctx.cfg["temperature"]
        coeffs = coefficients(g_lp, g_ent, e_z, inv_temp)
        dh, dw = _grads(hidden, weight, labels_local, ctx.n_valid, inv_temp, lse, coeffs, need_h, need_w, ctx.cfg)
        return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
                None, None)


class TritonFusedLinearLoss(torch.autograd.Function):
    """Stats kernel, the token loss on [T] vectors, then the grad kernel, all in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_loss_fn, cfg, metrics_out):
        hidden_c, weight_c, labels_local, n_valid, inv_temp = _prepare(hidden, weight, labels, cfg)
        entropy_on = cfg["compute_entropy"]
        lse, e_z, tgt = _stats(hidden_c, weight_c, labels_local, n_valid, inv_temp, cfg)
        logprob, entropy = tgt - lse, (lse - e_z if entropy_on else None)
        with torch.enable_grad():
            lp = logprob.detach().requires_grad_()
            ent = entropy.detach().requires_grad_() if entropy_on else None
            loss, metrics = token_loss_fn(lp, ent, slice(0, hidden.shape[0]))
            wrt = [lp] + ([ent] if entropy_on else [])
            grads = torch.autograd.grad(loss, wrt, allow_unused=True) if loss.requires_grad else [None] * len(wrt)
        metrics_out.update({k: v.detach() for k, v in metrics.items()})
        need_h, need_w = ctx.needs_input_grad[:2]
        g_lp, g_ent = grads[0], (grads[1] if entropy_on else None)
        dh = dw = None
        into = cfg["grad_weight_into"] if need_w else None
        if (need_h or need_w) and (g_lp is not None or g_ent is not None):
            coeffs = coefficients(g_lp, g_ent, e_z, inv_temp)
            if into is not None:
                coeffs = scale_coefficients(coeffs, cfg["grad_scale"])
            dh, dw = _grads(hidden_c, weight_c, labels_local, n_valid, inv_temp, lse, coeffs, need_h, need_w, cfg,
                            into)
        ctx.cfg, ctx.into = cfg, into is not None
        ctx.save_for_backward(None if dh is None else dh.to(hidden.dtype),
                              None if dw is None or ctx.into else dw.to(weight.dtype))
        ctx.mark_non_differentiable(logprob, *([entropy] if entropy_on else []))
        return loss.detach().float(), logprob, entropy

    @staticmethod
    def backward(ctx, g_loss, *_):
        dh, dw = ctx.saved_tensors
        if ctx.into:
            g_loss = unscale_for_backward(g_loss, ctx.cfg)
        return (None if dh is None else dh * g_loss, None if dw is None else dw * g_loss, None, None, None, None)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
