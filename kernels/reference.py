"""Plain-torch reference twin of the fused kernels: the oracle the fast paths are tested against.

Everything here is written for reading, not speed: it materialises the full [T, V] logits, runs
log-softmax over them and lets autograd do the backward. At T=4096 and V=151936 that is ~2.5 GB per
fp32 copy of the logits and autograd keeps several copies, which is exactly what the chunked and
Triton paths avoid. Statistics are computed in fp32 whatever the input dtype.

The GRPO token loss follows veRL's `compute_policy_loss` (vanilla PPO clip with separate low/high
ratios, dual-clip for negative advantages) and `kl_penalty`. It is token-local on purpose: the
per-token `weights` already carry the loss mask and the global normalisation (token-mean,
seq-mean-..., chosen by the caller), so the loss over a chunk of tokens is a plain weighted sum and
chunks can be processed independently.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

TokenLossFn = Callable[[torch.Tensor, Optional[torch.Tensor], slice], tuple[torch.Tensor, dict]]


def full_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of `labels` and entropy of softmax(hidden @ weight.T / temperature), full logits.

    `weight` is the whole (possibly padded) output layer [V_padded, H]; rows at or above
    `vocab_size` are padding and take no part in the softmax. A label outside [0, vocab_size)
    (e.g. an ignore index on a masked position) has no target logit: its log-prob is -logsumexp,
    a finite placeholder that a zero loss weight removes.
    """
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    logits = (hidden @ weight[:vocab_size].T).float() / temperature
    lse = torch.logsumexp(logits, dim=-1)
    valid = (labels >= 0) & (labels < vocab_size)
    target = logits.gather(-1, labels.clamp(0, vocab_size - 1).unsqueeze(-1)).squeeze(-1)
    logprob = torch.where(valid, target, torch.zeros_like(target)) - lse
    entropy = None
    if compute_entropy:
        logp_all = logits - lse.unsqueeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprob, entropy


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kl_type: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (veRL's names).

    k1 is unbiased but high variance and can go negative; k2 is the squared log-ratio; k3
    (alias low_var_kl) is Schulman's exp(r) - r - 1 with r = log(pi_ref / pi), non-negative and low
    variance. Like veRL, k3 clamps r to [-20, 20] before exp (no overflow) and the result to
    [-10, 10] so one far-off-policy token cannot dominate the batch.
    """
    if kl_type in ("k1", "kl"):
        return logprob - ref_logprob
    if kl_type in ("k2", "mse"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_type in ("k3", "low_var_kl"):
        r = (ref_logprob - logprob).clamp(-20.0, 20.0)
        return (torch.exp(r) - r - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl_loss_type {kl_type!r}: expected k1, k2, k3 or low_var_kl")


def grpo_token_loss(
    logprob: torch.Tensor,
    entropy: Optional[torch.Tensor],
    old_logprob: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    *,
    ref_logprob: Optional[torch.Tensor] = None,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    kl_loss_type: str = "low_var_kl",
    kl_coef: float = 0.0,
    entropy_coeff: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO/PPO loss of a set of tokens: returns (sum_t weights_t * loss_t, weighted metric sums).

    All inputs are per-token [n]. Metrics are weighted sums too, so with normalised weights they are
    the usual means, and summing them over chunks gives the value for the whole micro-batch.
    """
    log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)  # clamp: exp must not overflow
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg = torch.maximum(unclipped, clipped)
    metrics = {
        "pg_clipfrac": (weights * (clipped > unclipped).float()).sum(),
        "ppo_kl": (weights * -log_ratio).sum(),
    }
    if clip_ratio_c is not None:
        # Dual-clip (Ye et al. 2020): for A < 0 the clipped objective is unbounded as the ratio
        # grows; cap the loss at -A * c.
        capped = torch.minimum(pg, -advantages * clip_ratio_c)
        metrics["pg_clipfrac_lower"] = (weights * ((pg > capped) & (advantages < 0)).float()).sum()
        pg = torch.where(advantages < 0, capped, pg)
    loss = pg
    metrics["pg_loss"] = (weights * pg).sum()
    if ref_logprob is not None and kl_coef != 0.0:
        kl = kl_penalty(logprob, ref_logprob, kl_loss_type)
        loss = loss + kl_coef * kl
        metrics["kl_loss"] = (weights * kl).sum()
    if entropy is not None:
        if entropy_coeff != 0.0:
            loss = loss - entropy_coeff * entropy
        metrics["entropy"] = (weights * entropy).sum()
    metrics = {k: v.detach() for k, v in metrics.items()}
    return (weights * loss).sum(), metrics


def make_grpo_token_loss(old_logprob, advantages, weights, *, ref_logprob=None, **cfg) -> TokenLossFn:
    """Bind the per-token tensors of a micro-batch into a `token_loss_fn(logprob, entropy, sl)`."""

    def token_loss_fn(logprob, entropy, sl: slice):
        ref = None if ref_logprob is None else ref_logprob[sl]
        return grpo_token_loss(
            logprob, entropy, old_logprob[sl], advantages[sl], weights[sl], ref_logprob=ref, **cfg
        )

    return token_loss_fn


def full_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss_fn: TokenLossFn,
    *,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    compute_entropy: bool = True,
) -> tuple[torch.Tensor, dict, torch.Tensor, Optional[torch.Tensor]]:
    """The naive fused-loss twin: full logits, then the token loss over all tokens at once."""
    logprob, entropy = full_logprobs(
        hidden, weight, labels, temperature=temperature, vocab_size=vocab_size, compute_entropy=compute_entropy
    )
    loss, metrics = token_loss_fn(logprob, entropy, slice(0, labels.shape[0]))
    ent = None if entropy is None else entropy.detach()
    return loss, metrics, logprob.detach(), ent
