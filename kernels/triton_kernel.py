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

Left out on purpose: autotuning (one config per device class; this project has no GPU in CI to
tune on) and a persistent schedule; per-call block sizes are in `_blocks`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .chunked import coefficients, merge_stats, num_valid_rows


@triton.jit
def _logit_tile(H, W, offs_t, offs_v, tmask, vmask, hdim, stride_h, stride_w,
                BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """fp32 tile hidden[offs_t] @ weight[offs_v].T, accumulated over the hidden dimension in BK steps:
    the only place logits exist, one [BT, BV] tile at a time (both kernels recompute it)."""
    acc = tl.zeros([BT, BV], tl.float32)
    for k0 in range(0, hdim, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < hdim
        h = tl.load(H + offs_t[:, None] * stride_h + offs_k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(W + offs_v[:, None] * stride_w + offs_k[None, :], mask=vmask[:, None] & kmask[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=PREC)
    return acc


@triton.jit
def _stats_kernel(H, W, LAB, M, S, TT, TGT, n_tok, hdim, split, n_valid, inv_temp,
                  stride_h, stride_w,
                  BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                  ENTROPY: tl.constexpr, PREC: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT).to(tl.int64)  # int64: V * H can exceed 2^31 elements
    tmask = offs_t < n_tok
    lab = tl.load(LAB + offs_t, mask=tmask, other=-1)
    m = tl.full([BT], float("-inf"), tl.float32)
    s = tl.zeros([BT], tl.float32)
    t = tl.zeros([BT], tl.float32)
    tgt = tl.zeros([BT], tl.float32)
    v_lo = pid_s * split
    v_hi = tl.minimum(v_lo + split, n_valid)
    for v0 in range(v_lo, v_hi, BV):
        offs_v = v0 + tl.arange(0, BV).to(tl.int64)
        vmask = offs_v < v_hi
        acc = _logit_tile(H, W, offs_t, offs_v, tmask, vmask, hdim, stride_h, stride_w, BT, BV, BK, PREC)
        z = tl.where(vmask[None, :], acc * inv_temp, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))  # finite: every block has at least one valid row
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
def _grad_kernel(H, W, LAB, LSE, A, B, G, DH, DW, n_tok, hdim, n_valid, inv_temp,
                 stride_h, stride_w,
                 BT: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr,
                 NEED_DH: tl.constexpr, NEED_DW: tl.constexpr, PREC: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_v = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT).to(tl.int64)
    offs_v = pid_v * BV + tl.arange(0, BV).to(tl.int64)
    tmask = offs_t < n_tok
    vmask = offs_v < n_valid
    z = _logit_tile(H, W, offs_t, offs_v, tmask, vmask, hdim, stride_h, stride_w, BT, BV, BK, PREC) * inv_temp
    lse = tl.load(LSE + offs_t, mask=tmask, other=0.0)
    a = tl.load(A + offs_t, mask=tmask, other=0.0)
    b = tl.load(B + offs_t, mask=tmask, other=0.0)
    g = tl.load(G + offs_t, mask=tmask, other=0.0)
    lab = tl.load(LAB + offs_t, mask=tmask, other=-1)
    # Same algebra as chunked.tile_dlogits: dz = p * (a + b z) + g * onehot(label), 1/T folded in.
    p = tl.exp(z - lse[:, None])
    dz = p * (a[:, None] + b[:, None] * z) + tl.where(offs_v[None, :] == lab[:, None], g[:, None], 0.0)
    dz = tl.where(tmask[:, None] & vmask[None, :], dz, 0.0).to(H.dtype.element_ty)
    for k0 in range(0, hdim, BK):
        offs_k = k0 + tl.arange(0, BK)
        kmask = offs_k < hdim
        if NEED_DH:
            w = tl.load(W + offs_v[:, None] * stride_w + offs_k[None, :], mask=vmask[:, None] & kmask[None, :], other=0.0)
            tl.atomic_add(DH + offs_t[:, None] * hdim + offs_k[None, :], tl.dot(dz, w, input_precision=PREC),
                          mask=tmask[:, None] & kmask[None, :])
        if NEED_DW:
            h = tl.load(H + offs_t[:, None] * stride_h + offs_k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
            tl.atomic_add(DW + offs_v[:, None] * hdim + offs_k[None, :], tl.dot(tl.trans(dz), h, input_precision=PREC),
                          mask=vmask[:, None] & kmask[None, :])


def _blocks(device):
    if device.type != "cuda":  # TRITON_INTERPRET=1 on CPU: tiny tiles keep the interpreter fast
        return dict(BT=16, BV=16, BK=16), 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return dict(BT=64, BV=128, BK=64), sms


def triton_stats(hidden, weight, labels_local, n_valid, inv_temp, entropy, group):
    """Per-token (lse, E_p[z], target logit) in fp32; splits merged here, TP ranks by merge_stats."""
    n_tok, hdim = hidden.shape
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
    _stats_kernel[(t_blocks, n_splits)](
        hidden, weight, labels_local, part[0], part[1], part[2], part[3], n_tok, hdim, split, n_valid,
        inv_temp, hidden.stride(0), weight.stride(0), ENTROPY=entropy, PREC=prec, **blk)
    m, s, t, tgt = part.unbind(0)  # a shard of padding only keeps m = -inf, s = t = 0
    m_max = m.amax(0)
    scale = torch.where(torch.isinf(m), 0.0, torch.exp(m - m_max))
    return merge_stats(m_max, (s * scale).sum(0), (t * scale).sum(0), tgt.sum(0), group=group)


def triton_grads(hidden, weight, labels_local, n_valid, inv_temp, lse, coeffs, need_h, need_w):
    n_tok, hdim = hidden.shape
    a, b, g = coeffs
    b = torch.zeros_like(a) if b is None else b
    dh = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_h else None
    dw = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32) if need_w else None
    blk, _ = _blocks(hidden.device)
    if n_valid > 0 and n_tok > 0:
        grid = (triton.cdiv(n_tok, blk["BT"]), triton.cdiv(n_valid, blk["BV"]))
        dummy = a  # a valid pointer for a buffer the kernel is told not to touch
        _grad_kernel[grid](
            hidden, weight, labels_local, lse, a.contiguous(), b.contiguous(), g.contiguous(),
            dummy if dh is None else dh, dummy if dw is None else dw, n_tok, hdim, n_valid, inv_temp,
            hidden.stride(0), weight.stride(0), NEED_DH=need_h, NEED_DW=need_w,
            PREC="ieee" if hidden.dtype == torch.float32 else "tf32", **blk)
    return dh, dw


def _prepare(hidden, weight, labels, cfg):
    n_valid = num_valid_rows(weight.shape[0], cfg["vocab_start"], cfg["vocab_size"])
    labels_local = (labels.long() - cfg["vocab_start"]).contiguous()
    return hidden.contiguous(), weight.contiguous(), labels_local, n_valid, 1.0 / cfg["temperature"]


def _allreduce_(x, group):
    if x is not None and group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(x, group=group)
    return x


class TritonLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, cfg):
        hidden, weight, labels_local, n_valid, inv_temp = _prepare(hidden, weight, labels, cfg)
        lse, e_z, tgt = triton_stats(hidden, weight, labels_local, n_valid, inv_temp, cfg["compute_entropy"],
                                     cfg["tp_group"])
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
        dh, dw = triton_grads(hidden, weight, labels_local, ctx.n_valid, inv_temp, lse, coeffs, need_h, need_w)
        dh = _allreduce_(dh, ctx.cfg["tp_group"])  # hidden is replicated over the TP group
        return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
                None, None)


class TritonFusedLinearLoss(torch.autograd.Function):
    """Stats kernel, the token loss on [T] vectors, then the grad kernel, all in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, token_loss_fn, cfg, metrics_out):
        hidden_c, weight_c, labels_local, n_valid, inv_temp = _prepare(hidden, weight, labels, cfg)
        entropy_on = cfg["compute_entropy"]
        lse, e_z, tgt = triton_stats(hidden_c, weight_c, labels_local, n_valid, inv_temp, entropy_on, cfg["tp_group"])
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
        if (need_h or need_w) and (g_lp is not None or g_ent is not None):
            coeffs = coefficients(g_lp, g_ent, e_z, inv_temp)
            dh, dw = triton_grads(hidden_c, weight_c, labels_local, n_valid, inv_temp, lse, coeffs, need_h, need_w)
            dh = _allreduce_(dh, cfg["tp_group"])
        ctx.save_for_backward(None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype))
        ctx.mark_non_differentiable(logprob, *([entropy] if entropy_on else []))
        return loss.detach().float(), logprob, entropy

    @staticmethod
    def backward(ctx, g_loss, *_):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else dh * g_loss, None if dw is None else dw * g_loss, None, None, None, None)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
