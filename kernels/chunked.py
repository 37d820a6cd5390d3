"""Chunked log-prob / entropy / token-loss over a (vocab-parallel) output layer, in plain torch.

The CPU production path and the fallback everywhere. The [T, V] logits are never materialised:
tokens are processed `chunk_size` at a time and, inside a chunk, the vocabulary `vocab_chunk_size`
rows at a time with an online log-sum-exp (running max m, sum-exp s, and for the entropy the
running sum t of exp(z - m) * z). Those three numbers per token are all a softmax needs, so they
also combine across tensor-parallel ranks with two O(tokens) all-reduces (MAX, then SUM), and the
backward recomputes logits tile by tile from them.

Statistics are fp32 whatever the input dtype: a bf16 sum over 150k exp-terms rounds away most of
them (8-bit mantissa), and an lse off by a few hundredths of a nat moves every importance ratio by
a few percent, a sizeable fraction of the PPO clip range of 0.2. The GEMMs are fine in bf16.

Sampling supports (top-k / top-p, see support.py): with a per-token support each chunk runs over the
union of its tokens' supports on this shard (gathered weight rows, or every row when the union is large)
and columns outside a token's own support take the logit NEG, so the same three statistics, the same
merge and the same gradient algebra give the support-renormalised log-prob and entropy.

Two entry points:
- `linear_logprobs` is a normal autograd Function (forward: 1 GEMM, backward: 3 GEMMs).
- `fused_linear_loss` also runs the caller's token loss chunk by chunk and computes dHidden and
  dWeight right there in the forward, from the chunk's logits it still holds, so forward+backward
  costs 3 GEMMs and one chunk of logits; its backward only scales the stored grads (Liger's trick).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from .support import NEG, ChunkColumns, all_columns, chunk_columns

# Tuned with benchmarks/peers/kernel_bench.py on 2 CPU cores, H=1024, V=151936: the fused path keeps chunk x V_local
# fp32 logits alive (311 MB here, ~0.9 GB peak with dWeight vs ~11.9 GB for full logits); 512 tokens
# ran ~7% faster than 256 and ~15% faster than 128 (larger GEMMs), for +150 MB per doubling.
DEFAULT_CHUNK_SIZE = 512
# Vocab rows per tile: the elementwise passes over a 512 x 8192 fp32 tile (16 MB) stay in cache;
# 4096..16384 measured within noise of each other.
DEFAULT_VOCAB_CHUNK = 8192


def num_valid_rows(v_local: int, vocab_start: int, vocab_size: Optional[int]) -> int:
    """Rows of this shard that are real tokens; rows with global id >= vocab_size are padding."""
    if vocab_size is None:
        return v_local
    return max(0, min(v_local, vocab_size - vocab_start))


def _tile_logits(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """out <- (h @ w.T) * inv_temp in fp32, reusing `out` (fresh pages cost more than the math)."""
    if h.dtype == torch.float32:
        return torch.addmm(out, h, w.T, beta=0.0, alpha=inv_temp, out=out)
    return out.copy_(h @ w.T).mul_(inv_temp)  # low-precision GEMM, fp32 statistics


def _tiles(n_valid: int, vocab_chunk: int):
    return [(lo, min(lo + vocab_chunk, n_valid)) for lo in range(0, n_valid, vocab_chunk)]


def chunk_stats(h, w, plan: ChunkColumns, inv_temp, vocab_chunk, entropy, zbuf, scratch, keep=False):
    """Online log-sum-exp of one token chunk over the columns `plan` gives it on this shard.

    Returns fp32 partial stats (m, s, t, target) per token (target: the label's logit when this
    shard owns the label, else 0) and the logit tiles. With keep=True every tile gets its own slice
    of `zbuf` (chunk x columns) so the fused gradient can reuse them; else one slice is recycled.
    """
    n = h.shape[0]
    f32 = dict(device=h.device, dtype=torch.float32)
    m = torch.full((n,), -math.inf, **f32)
    s, t, target = (torch.zeros(n, **f32) for _ in range(3))
    tiles, offset = [], 0
    for lo, hi in _tiles(plan.n_cols, vocab_chunk):
        z = _masked_tile(zbuf[offset : offset + n * (hi - lo)].view(n, hi - lo), h, w, plan, lo, hi, inv_temp)
        if keep:
            tiles.append(((lo, hi), z))
            offset += z.numel()
        m_new = torch.maximum(m, z.amax(-1))
        e = torch.sub(z, m_new[:, None], out=scratch[: z.numel()].view_as(z)).exp_()
        rescale = torch.exp(m - m_new)  # exp(-inf) = 0 on the first tile
        s = s * rescale + e.sum(-1)
        if entropy:
            t = t * rescale + e.mul_(z).sum(-1)  # in place: e is scratch and no longer needed
        m = m_new
        owned = (plan.label_col >= lo) & (plan.label_col < hi)
        col = (plan.label_col - lo).clamp(0, hi - lo - 1)
        target += torch.where(owned, z.gather(1, col[:, None]).squeeze(1), 0.0)
    return (m, s, t, target), tiles


def _masked_tile(out, h, w, plan: ChunkColumns, lo, hi, inv_temp):
    """Logits of column positions lo..hi-1; NEG where a column is outside the token's support."""
    z = _tile_logits(out, h, plan.weight_rows(w, lo, hi), inv_temp)
    member = plan.member(lo, hi)
    return z if member is None else z.masked_fill_(~member, NEG)


def merge_stats(m, s, t, target, group=None):
    """Combine per-shard partial stats into lse, E_p[z] and the target logit (all fp32)."""
    if group is not None and dist.get_world_size(group) > 1:
        m_all = m.clone()
        dist.all_reduce(m_all, op=dist.ReduceOp.MAX, group=group)
        scale = torch.exp(m - m_all)  # a shard with no valid rows has m = -inf and scale 0
        packed = torch.stack([s * scale, t * scale, target])
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        m, (s, t, target) = m_all, packed.unbind(0)
    lse = m + torch.log(s)
    return lse, t / s, target


def tile_dlogits(z, lse, a, b, g_tgt, label_col, lo, scratch):
    """In place on z: dL/dlogits = p * (a + b * z) + g_tgt * onehot(label), p = exp(z - lse).

    With z = logits / T, p the softmax, logprob = z_y - lse and entropy = lse - E_p[z]:
      dlogprob/dz_k = 1[k=y] - p_k,   dentropy/dz_k = -p_k * (z_k - E_p[z]),
    so dL/dz_k = p_k * (-g_lp + g_ent * E_p[z] - g_ent * z_k) + g_lp * 1[k=y]; `coefficients`
    folds these per-token numbers and the 1/T of dz/dlogits into a, b and g_tgt. A column outside the
    token's support holds NEG: p_k = exp(NEG - lse) = 0 exactly, so its dz is 0.
    """
    p = torch.sub(z, lse[:, None], out=scratch[: z.numel()].view_as(z)).exp_()
    if b is None:  # the loss does not use the entropy: one pass fewer
        dz = torch.mul(p, a[:, None], out=z)
    else:
        dz = torch.addcmul(a[:, None], z, b[:, None], out=z).mul_(p)
    owned = (label_col >= lo) & (label_col < lo + z.shape[1])
    col = (label_col - lo).clamp(0, z.shape[1] - 1)
    dz.scatter_add_(1, col[:, None], torch.where(owned, g_tgt, 0.0)[:, None])
    return dz


def coefficients(g_lp, g_ent, e_z, inv_temp):
    g_lp = torch.zeros_like(e_z) if g_lp is None else g_lp.float()
    a = -g_lp if g_ent is None else g_ent.float() * e_z - g_lp
    b = None if g_ent is None else -g_ent.float() * inv_temp
    return a * inv_temp, b, g_lp * inv_temp


def _addmm(out, a, b):
    """out += a @ b, in place when dtypes allow (fp32); low-precision GEMM into fp32 otherwise."""
    if out.dtype == a.dtype == b.dtype:
        return out.addmm_(a, b)
    return out.add_(a @ b)


def grad_tiles(tiles, h, w, plan: ChunkColumns, lse, coeffs, dh, dw, scratch):
    """Accumulate one token chunk's dHidden (into dh) and dWeight (into dw) from its logit tiles."""
    a, b, g_tgt = coeffs
    for (lo, hi), z in tiles:
        dz = tile_dlogits(z, lse, a, b, g_tgt, plan.label_col, lo, scratch).to(w.dtype)
        if dh is not None:
            _addmm(dh, dz, plan.weight_rows(w, lo, hi))
        if dw is not None:
            if plan.cols is None:
                _addmm(dw[lo:hi], dz.T, h)
            else:
                plan.add_weight_grad(dw, lo, hi, dz.T @ h)


def _recomputed_tiles(h, w, plan: ChunkColumns, inv_temp, vocab_chunk, zbuf):
    n = h.shape[0]
    for lo, hi in _tiles(plan.n_cols, vocab_chunk):
        yield (lo, hi), _masked_tile(zbuf[: n * (hi - lo)].view(n, hi - lo), h, w, plan, lo, hi, inv_temp)


class _Setup:
    """Per-call constants and reusable buffers (allocated once: fresh pages cost more than math)."""

    def __init__(self, hidden, weight, labels, cfg, keep):
        self.n_valid = num_valid_rows(weight.shape[0], cfg["vocab_start"], cfg["vocab_size"])
        self.inv_temp = 1.0 / cfg["temperature"]
        self.chunk = max(1, min(cfg["chunk_size"], hidden.shape[0]))
        self.vocab_chunk = max(1, min(cfg["vocab_chunk_size"], max(self.n_valid, 1)))
        self.labels_local = labels.long() - cfg["vocab_start"]
        self.support, self.vocab_start = cfg["support"], cfg["vocab_start"]
        zsize = self.chunk * (max(self.n_valid, 1) if keep else self.vocab_chunk)
        f32 = dict(device=hidden.device, dtype=torch.float32)
        self.zbuf = torch.empty(zsize, **f32)
        self.scratch = torch.empty(self.chunk * self.vocab_chunk, **f32)

    def chunks(self, n_tokens):
        return [slice(a, min(a + self.chunk, n_tokens)) for a in range(0, n_tokens, self.chunk)]

    def columns(self, sl: slice) -> ChunkColumns:
        """The columns chunk `sl` needs on this shard (all valid rows without supports)."""
        if self.support is None:
            return all_columns(self.n_valid, self.labels_local[sl])
        return chunk_columns(*self.support, sl, self.labels_local[sl], self.vocab_start, self.n_valid)


def _grad_buffers(hidden, weight, need_h, need_w, into=None):
    # fp32 accumulators: low-precision grads summed over many chunks would lose their small terms.
    # `into`: the caller's fp32 buffer that dWeight is added to (fused_linear_loss's grad_weight_into).
    dh = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float32) if need_h else None
    dw = (into if into is not None else torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)) \
        if need_w else None
    return dh, dw


def _allreduce_(x, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x


def scale_coefficients(coeffs, scale: float):
    """The per-token coefficients times `scale`: dLogits, so dHidden and dWeight, come out scaled."""
    return tuple(None if c is None else c * scale for c in coeffs)


def unscale_for_backward(g_loss, cfg) -> torch.Tensor:
    """The fused losses' backward with cfg["grad_weight_into"]: the forward added dWeight to that buffer already,
    scaled by cfg["grad_scale"], the gradient the caller announced the loss would receive (and dHidden the same),
    so dWeight never needs a [vocab x hidden] buffer of its own (Megatron's gradient-accumulation fusion, done
    where the fused kernel computes dWeight: in the forward). Returns what the stored dHidden must still be
    multiplied by; a loss that receives another gradient than announced is an error, not a wrong update."""
    scale = cfg["grad_scale"]
    got = float(g_loss)
    if not math.isclose(got, scale, rel_tol=1e-6):
        raise RuntimeError(f"the fused log-prob loss received gradient {got!r} but grad_scale={scale!r} was announced "
                           "at its forward, which added dWeight to grad_weight_into scaled by it")
    return g_loss / scale


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, cfg):
        ws = _Setup(hidden, weight, labels, cfg, keep=False)
        n_tok = hidden.shape[0]
        lse, e_z, logprob = (torch.empty(n_tok, device=hidden.device, dtype=torch.float32) for _ in range(3))
        for sl in ws.chunks(n_tok):
            stats, _ = chunk_stats(hidden[sl], weight, ws.columns(sl), ws.inv_temp, ws.vocab_chunk,
                                   cfg["compute_entropy"], ws.zbuf, ws.scratch)
            lse[sl], e_z[sl], target = merge_stats(*stats, group=cfg["tp_group"])
            logprob[sl] = target - lse[sl]
        # Saved: the inputs and 2 fp32 numbers per token; the backward recomputes logit tiles.
        ctx.save_for_backward(hidden, weight, labels, lse, e_z)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return logprob, (lse - e_z if cfg["compute_entropy"] else None)

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, labels, lse, e_z = ctx.saved_tensors
        cfg = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[:2]
        if (g_lp is None and g_ent is None) or not (need_h or need_w):
            return None, None, None, None
        ws = _Setup(hidden, weight, labels, cfg, keep=False)
        dh, dw = _grad_buffers(hidden, weight, need_h, need_w)
        for sl in ws.chunks(hidden.shape[0]):
            coeffs = coefficients(None if g_lp is None else g_lp[sl], None if g_ent is None else g_ent[sl],
                                  e_z[sl], ws.inv_temp)
            h, plan = hidden[sl], ws.columns(sl)
            tiles = _recomputed_tiles(h, weight, plan, ws.inv_temp, ws.vocab_chunk, ws.zbuf)
            grad_tiles(tiles, h, weight, plan, lse[sl], coeffs, None if dh is None else dh[sl], dw, ws.scratch)
        if dh is not None:
            dh = _allreduce_(dh, cfg["tp_group"]).to(hidden.dtype)  # hidden is replicated over TP
        return dh, None if dw is None else dw.to(weight.dtype), None, None


class _FusedLinearLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, token_loss_fn, cfg, metrics_out):
        ws = _Setup(hidden, weight, labels, cfg, keep=True)
        need_h, need_w = ctx.needs_input_grad[:2]
        into = cfg["grad_weight_into"] if need_w else None
        dh, dw = _grad_buffers(hidden, weight, need_h, need_w, into)
        n_tok, entropy_on = hidden.shape[0], cfg["compute_entropy"]
        logprob = torch.empty(n_tok, device=hidden.device, dtype=torch.float32)
        entropy = torch.empty_like(logprob) if entropy_on else None
        loss = torch.zeros((), device=hidden.device, dtype=torch.float32)
        for sl in ws.chunks(n_tok):
            h, plan = hidden[sl], ws.columns(sl)
            stats, tiles = chunk_stats(h, weight, plan, ws.inv_temp, ws.vocab_chunk, entropy_on, ws.zbuf,
                                       ws.scratch, keep=True)
            lse, e_z, target = merge_stats(*stats, group=cfg["tp_group"])
            logprob[sl] = target - lse
            if entropy_on:
                entropy[sl] = lse - e_z
            # Autograd only over O(chunk) vectors: dLoss/dlogprob and dLoss/dentropy per token.
            with torch.enable_grad():
                lp = logprob[sl].detach().requires_grad_()
                ent = entropy[sl].detach().requires_grad_() if entropy_on else None
                loss_c, metrics_c = token_loss_fn(lp, ent, sl)
                wrt = [lp] + ([ent] if entropy_on else [])
                grads = (torch.autograd.grad(loss_c, wrt, allow_unused=True) if loss_c.requires_grad
                         else [None] * len(wrt))
            loss += loss_c.detach().float()
            for k, v in metrics_c.items():
                metrics_out[k] = metrics_out.get(k, 0.0) + v.detach()
            g_lp, g_ent = grads[0], (grads[1] if entropy_on else None)
            if (need_h or need_w) and (g_lp is not None or g_ent is not None):
                # The chunk's logits are still in ws.zbuf: use them now instead of recomputing
                # them in a backward pass (3 GEMMs in all instead of 4).
                coeffs = coefficients(g_lp, g_ent, e_z, ws.inv_temp)
                if into is not None:
                    coeffs = scale_coefficients(coeffs, cfg["grad_scale"])
                grad_tiles(tiles, h, weight, plan, lse, coeffs, None if dh is None else dh[sl], dw, ws.scratch)
        if dh is not None:
            dh = _allreduce_(dh, cfg["tp_group"]).to(hidden.dtype)  # hidden is replicated over TP
        ctx.cfg = cfg
        ctx.into = into is not None
        ctx.save_for_backward(dh, None if dw is None or ctx.into else dw.to(weight.dtype))
        ctx.mark_non_differentiable(logprob, *([entropy] if entropy_on else []))
        return loss, logprob, entropy

    @staticmethod
    def backward(ctx, g_loss, *_):
        dh, dw = ctx.saved_tensors
        if ctx.into:
            g_loss = unscale_for_backward(g_loss, ctx.cfg)
        if bool(g_loss != 1):  # the usual loss.backward() passes 1: hand over the stored grads, no copy
            dh = None if dh is None else dh * g_loss
            dw = None if dw is None else dw * g_loss
        return dh, dw, None, None, None, None


def check_grad_weight_into(into, grad_scale, weight) -> None:
    if into is None:
        return
    if into.dtype != torch.float32 or into.shape != weight.shape:
        raise ValueError(f"grad_weight_into must be a float32 tensor of the weight's shape {tuple(weight.shape)} "
                         f"(a DDP main_grad buffer), got {into.dtype} {tuple(into.shape)}")
    if grad_scale is None or not grad_scale > 0:
        raise ValueError(f"grad_weight_into needs grad_scale, the gradient the loss will receive (> 0), got "
                         f"{grad_scale!r}")


def make_config(temperature, chunk_size, vocab_chunk_size, tp_group, vocab_start, vocab_size, compute_entropy,
                support=None, grad_weight_into=None, grad_scale=None):
    """The kernels' per-call settings; `support` is (support_offsets, support_ids) or None (see support.py);
    `grad_weight_into`: see `fused_linear_loss`."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1 or vocab_chunk_size < 1:
        raise ValueError(f"chunk_size and vocab_chunk_size must be >= 1, got {chunk_size}, {vocab_chunk_size}")
    return dict(temperature=float(temperature), chunk_size=int(chunk_size), vocab_chunk_size=int(vocab_chunk_size),
                tp_group=tp_group, vocab_start=int(vocab_start), vocab_size=vocab_size,
                compute_entropy=bool(compute_entropy), support=support, grad_weight_into=grad_weight_into,
                grad_scale=None if grad_scale is None else float(grad_scale))


def linear_logprobs(hidden, weight, labels, *, temperature=1.0, chunk_size=DEFAULT_CHUNK_SIZE,
                    vocab_chunk_size=DEFAULT_VOCAB_CHUNK, tp_group=None, vocab_start=0, vocab_size=None,
                    compute_entropy=True, support=None):
    """(logprob [T] fp32, entropy [T] fp32 or None) of labels under softmax(hidden @ weight.T / T).

    `weight` is this rank's rows [vocab_start, vocab_start + V_local) of the padded vocabulary; rows
    with global id >= vocab_size are padding. With `support` = (offsets, ids) each token's softmax is
    over its own support (support.py). Differentiable w.r.t. hidden and weight.
    """
    cfg = make_config(temperature, chunk_size, vocab_chunk_size, tp_group, vocab_start, vocab_size, compute_entropy,
                      support)
    return _LinearLogprobs.apply(hidden, weight, labels, cfg)


def fused_linear_loss(hidden, weight, labels, token_loss_fn, *, temperature=1.0, chunk_size=DEFAULT_CHUNK_SIZE,
                      vocab_chunk_size=DEFAULT_VOCAB_CHUNK, tp_group=None, vocab_start=0, vocab_size=None,
                      compute_entropy=True, support=None, grad_weight_into=None, grad_scale=None):
    """(loss, metrics, logprob, entropy) of a token-local loss, grads computed during the forward.

    token_loss_fn(logprob_chunk, entropy_chunk, sl) -> (loss_sum_chunk, {name: scalar}) must be a
    sum over the chunk's tokens (weights carry mask and normalisation); losses and metrics are summed
    over chunks. logprob and entropy come back detached. `support` as in `linear_logprobs`.
    `grad_weight_into` (a float32 tensor of weight's shape: Megatron DDP's `weight.main_grad`) with `grad_scale`
    (the gradient the returned loss will receive in the backward): dWeight * grad_scale is added to the buffer
    during the forward and never reaches autograd (weight.grad gets only what other uses of the weight send);
    the backward checks that the loss received grad_scale (`unscale_for_backward`).
    """
    check_grad_weight_into(grad_weight_into, grad_scale, weight)
    cfg = make_config(temperature, chunk_size, vocab_chunk_size, tp_group, vocab_start, vocab_size, compute_entropy,
                      support, grad_weight_into, grad_scale)
    metrics: dict = {}
    loss, logprob, entropy = _FusedLinearLoss.apply(hidden, weight, labels, token_loss_fn, cfg, metrics)
    return loss, metrics, logprob, entropy
