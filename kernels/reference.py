"""Plain-torch reference twin of the fused kernels: the oracle the fast paths are tested against.

Everything here is written for reading, not speed: it materialises the full [T, V] logits, runs
log-softmax over them and lets autograd do the backward. At T=4096 and V=151936 that is ~2.5 GB per
fp32 copy of the logits and autograd keeps several copies, which is exactly what the chunked and
Triton paths avoid. Statistics are computed in fp32 whatever the input dtype.

The kernels are loss-agnostic: `token_loss_fn(logprob, entropy, sl)` is whatever token-local loss
the caller binds (production: `mgrpo.algorithms.policy_loss.make_token_loss_fn`, which the kernel
tests and the benchmark use too, so there is one definition of the GRPO loss). Its per-token weights
carry the loss mask and the global normalisation, so the loss over a chunk of tokens is a plain
weighted sum and chunks can be processed independently.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .support import support_mask

TokenLossFn = Callable[[torch.Tensor, Optional[torch.Tensor], slice], tuple[torch.Tensor, dict]]


def full_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    compute_entropy: bool = True,
    support_offsets: Optional[torch.Tensor] = None,
    support_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of `labels` and entropy of softmax(hidden @ weight.T / temperature), full logits.

    `weight` is the whole (possibly padded) output layer [V_padded, H]; rows at or above
    `vocab_size` are padding and take no part in the softmax. A label outside [0, vocab_size)
    (e.g. an ignore index on a masked position) has no target logit: its log-prob is -logsumexp,
    a finite placeholder that a zero loss weight removes. With a support (CSR offsets and global ids,
    an empty row = the whole vocabulary; see support.py) each token's softmax runs over its own
    support only: every other logit is -inf.
    """
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    logits = (hidden @ weight[:vocab_size].T).float() / temperature
    member = None
    if support_offsets is not None:
        member = support_mask(support_offsets, support_ids, labels.shape[0], vocab_size)
        logits = logits.masked_fill(~member, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    valid = (labels >= 0) & (labels < vocab_size)
    target = logits.gather(-1, labels.clamp(0, vocab_size - 1).unsqueeze(-1)).squeeze(-1)
    logprob = torch.where(valid, target, torch.zeros_like(target)) - lse
    entropy = None
    if compute_entropy:
        logp_all = logits - lse.unsqueeze(-1)
        p = logp_all.exp()  # 0 outside a support
        if member is not None:  # there log p = -inf and 0 * -inf = nan: those terms are 0
            logp_all = torch.where(member, logp_all, torch.zeros_like(logp_all))
        entropy = -(p * logp_all).sum(-1)
    return logprob, entropy


def full_linear_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_loss_fn: TokenLossFn,
    *,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    compute_entropy: bool = True,
    support_offsets: Optional[torch.Tensor] = None,
    support_ids: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict, torch.Tensor, Optional[torch.Tensor]]:
    """The naive fused-loss twin: full logits, then the token loss over all tokens at once."""
    logprob, entropy = full_logprobs(
        hidden, weight, labels, temperature=temperature, vocab_size=vocab_size, compute_entropy=compute_entropy,
        support_offsets=support_offsets, support_ids=support_ids,
    )
    loss, metrics = token_loss_fn(logprob, entropy, slice(0, labels.shape[0]))
    ent = None if entropy is None else entropy.detach()
    return loss, metrics, logprob.detach(), ent
