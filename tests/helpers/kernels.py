"""Problems for the fused log-prob / loss kernel tests: a random hidden state and LM-head weight (padding rows
that would swamp the softmax if they took part), labels with ignored positions, GRPO loss inputs; and one call
of each implementation (fused, naive reference) returning outputs and gradients."""

from __future__ import annotations

import mgrpo_kernels as K
import torch
from mgrpo_kernels.reference import full_logprobs

from mgrpo.algorithms.policy_loss import TokenLossInputs, make_token_loss_fn
from mgrpo.config import AlgorithmConfig


SMALL_CHUNKS = dict(chunk_size=16, vocab_chunk_size=24)


def make_problem(T=50, H=32, V=96, vocab_size=None, seed=0, dtype=torch.float32):
    """hidden, full weight [V, H] (rows >= vocab_size are 'padding' with big values), labels, loss inputs."""
    g = torch.Generator().manual_seed(seed)
    real = V if vocab_size is None else vocab_size
    hidden = torch.randn(T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    weight[real:] = 5.0  # padding rows: if they took part, their logits would swamp the softmax
    labels = torch.randint(0, real, (T,), generator=g)
    mask = torch.rand(T, generator=g) > 0.2
    mask[:4] = True
    labels[~mask] = -100  # an ignore index on masked positions must be harmless
    with torch.no_grad():
        lp, _ = full_logprobs(hidden, weight, labels, vocab_size=vocab_size)
    # Old/ref log-probs off by up to ~1.5 nats so that clipping and dual-clip both engage.
    old_lp = lp + 0.6 * torch.randn(T, generator=g)
    ref_lp = lp + 0.6 * torch.randn(T, generator=g)
    adv = torch.randn(T, generator=g)
    old_lp[:4], adv[:4] = lp[:4] - 2.0, -1.0  # ratio e^2 > clip_ratio_c with A < 0: dual-clip territory
    weights = mask.float() / mask.sum()
    return dict(hidden=hidden.to(dtype), weight=weight.to(dtype), labels=labels, old_lp=old_lp, ref_lp=ref_lp,
                adv=adv, weights=weights, mask=mask)


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def leaves(p):
    return p["hidden"].clone().requires_grad_(), p["weight"].clone().requires_grad_()


def grpo_fn(p, **cfg):
    """The production GRPO token loss (what training/forward.py hands the kernel) on this problem's
    tensors; a KL term when kl_coef is non-zero."""
    algo = AlgorithmConfig(use_kl_loss=cfg.get("kl_coef", 0.0) != 0.0, **cfg)
    inputs = TokenLossInputs(old_logprob=p["old_lp"], advantages=p["adv"], token_weight=p["weights"],
                             metric_weight=p["weights"], ref_logprob=p["ref_lp"])
    return make_token_loss_fn(inputs, algo)


def run_logprobs(p, impl, **kw):
    h, w = leaves(p)
    lp, ent = K.linear_logprobs(h, w, p["labels"], impl=impl, **kw)
    # Any downstream use: mixes both outputs, masked tokens included.
    c = torch.linspace(-1.0, 1.0, lp.shape[0])
    (c * lp + 0.5 * c.flip(0) * ent).sum().backward()
    return lp.detach(), ent.detach(), h.grad, w.grad


def run_loss(p, impl, fn, scale=1.0, **kw):
    h, w = leaves(p)
    loss, metrics, lp, ent = K.fused_linear_loss(h, w, p["labels"], fn, impl=impl, **kw)
    (scale * loss).backward()
    return loss.detach(), metrics, lp, ent, h.grad, w.grad


def run_tied_loss(p, impl, fn, scale=2.0, into=False, **kw):
    """The kernel's weight tied to an input embedding (as Qwen3's small models are): the weight's whole gradient
    (autograd's, plus what the kernel added to a main_grad buffer when `into`) and the part autograd gave it.
    The buffer starts at 1.0, as one holding an earlier micro-batch's gradient: the kernel must add to it."""
    h, w = leaves(p)
    ids = torch.arange(h.shape[0]) % w.shape[0]
    tokens = torch.nn.functional.embedding(ids, w)  # [T, H], the same weight as the output layer
    buf = torch.ones(w.shape) if into else None
    loss, *_ = K.fused_linear_loss(h + 0.1 * tokens, w, p["labels"], fn, impl=impl, grad_weight_into=buf,
                                   grad_scale=scale if into else None, **kw)
    (scale * loss).backward()
    total = w.grad + (buf - 1.0 if into else 0.0)
    return total, w.grad
