"""Policy losses: PPO-clip (clip-higher, dual-clip, truncated IS) and GSPO, plus KL and entropy terms.

Everything is a weighted sum over flattened response tokens [T]. `TokenLossInputs.token_weight`
carries the mask and the global normalisation (see aggregation.py), so the loss of any subset of
tokens is its share of the global loss, and losses and metrics add up across chunks, micro-batches
and data-parallel ranks (all-reduce SUM). Metrics follow veRL's names:
  actor/pg_loss, actor/kl_loss, actor/entropy  weighted by token_weight (the loss's own aggregation)
  actor/pg_clipfrac, actor/pg_clipfrac_lower,
  actor/ppo_kl                                 token means, weighted by metric_weight (1/global tokens)

Per-token objective of `vanilla` (r = pi/pi_old, A = advantage, eps_l/eps_h = clip_ratio_low/high):
    pg = max(-A r, -A clip(r, 1 - eps_l, 1 + eps_h))         PPO clip; eps_h > eps_l is DAPO clip-higher
    pg = min(pg, -A c)  where A < 0                          dual-clip (Ye et al. 2020), when clip_ratio_c
    pg = pg * min(pi_old / pi_rollout, tis_cap)              truncated IS (detached), when tis_cap
    loss = pg + kl_coef * KL(pi, pi_ref) - entropy_coeff * H  (KL only with use_kl_loss)

`gspo` (Zheng et al. 2025) replaces r with the sequence-level ratio s_i = exp(mean_t log(pi/pi_old))
(the geometric mean of the token ratios), clipped per sequence; per token it uses veRL's
s_it = sg[s_i] * pi_t / sg[pi_t], whose value is s_i and whose gradient flows through every token.
Like veRL 0.9.1's `compute_policy_loss_gspo`, the per-token losses are then aggregated with
algorithm.loss_agg_mode (token-mean unless set; the GSPO paper's objective is seq-mean-token-mean,
which configs/algorithm/gspo.yaml sets). s_i needs all of a sequence's log-probs at once, so gspo runs
only through `policy_loss`, never the chunked `make_token_loss_fn`: its registry entry says
token_level=False, which the trainer asks. The losses are registered in registry.py.

actor/ppo_kl is the token mean of log(pi_old/pi) as each veRL 0.9.1 loss reports it: vanilla from the
log-ratio clamped to [-20, 20] (the same clamp its ratio uses), gspo from the raw log-ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mgrpo.algorithms.kl import kl_estimate
from mgrpo.algorithms.registry import POLICY_LOSSES, PolicyLoss
from mgrpo.config.schema import AlgorithmConfig

Tensor = torch.Tensor
TokenLossFn = Callable[[Tensor, Optional[Tensor], slice], tuple[Tensor, dict[str, Tensor]]]

LOG_RATIO_CLAMP = 20.0  # |log pi/pi_old| cap before exp, as veRL: exp must not overflow


@dataclass
class TokenLossInputs:
    """Per-token tensors [T] of the response tokens of one micro-batch, flattened in one order.

    Padding tokens may be included with token_weight = 0 (their other values must be finite); a
    token with token_weight 0 counts in no loss and no metric. Everything here is a constant of the
    update (no grad).
    """

    old_logprob: Tensor
    """log pi_old of the sampled token (the policy before this optimizer step)."""
    advantages: Tensor
    token_weight: Tensor
    """Aggregation weight from aggregation.token_weights (mask and global normalisation)."""
    metric_weight: Tensor
    """1 / global response tokens on response tokens, 0 on padding."""
    ref_logprob: Optional[Tensor] = None
    """log pi_ref; required when use_kl_loss."""
    rollout_logprob: Optional[Tensor] = None
    """log-prob under the rollout engine; required when tis_cap is set."""
    seq_index: Optional[Tensor] = None
    """Long [T]: which response each token belongs to (any ids); required for sequence-level losses (gspo)."""

    def __len__(self) -> int:
        return self.old_logprob.shape[0]


def _check(inputs: TokenLossInputs, cfg: AlgorithmConfig) -> PolicyLoss:
    """The registry entry of cfg.policy_loss, after checking `inputs` hold what it and cfg need."""
    entry = POLICY_LOSSES.lookup(cfg.policy_loss)
    if cfg.use_kl_loss and inputs.ref_logprob is None:
        raise ValueError("algorithm.use_kl_loss=True needs TokenLossInputs.ref_logprob")
    if cfg.tis_cap is not None and inputs.rollout_logprob is None:
        raise ValueError("algorithm.tis_cap is set but TokenLossInputs.rollout_logprob is None")
    if not entry.token_level and inputs.seq_index is None:
        raise ValueError(f"algorithm.policy_loss={cfg.policy_loss!r} is sequence-level and needs "
                         "TokenLossInputs.seq_index")
    return entry


def tis_weight(old_logprob: Tensor, rollout_logprob: Tensor, cap: float) -> Tensor:
    """min(pi_old / pi_rollout, cap), detached: corrects for the rollout engine's numerics differing
    from the trainer's (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy
    RL training"). The min is taken in log space so no exp overflows on padding."""
    return torch.exp(torch.clamp(old_logprob - rollout_logprob, max=math.log(cap))).detach()


def _ppo_clip(log_ratio: Tensor, adv: Tensor, low: float, high: float,
              c: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    """(per-token pg loss, clipped indicator, dual-clipped indicator) of PPO-clip on `log_ratio`."""
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - low, 1.0 + high)
    pg = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    is_lower = torch.zeros_like(is_clipped)
    if c is not None:
        # For A < 0 the clipped objective still grows without bound with the ratio; cap it at -A*c.
        cap = -adv * c
        is_lower = (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    return pg, is_clipped, is_lower


def vanilla_pg(logprob: Tensor, inputs: TokenLossInputs, sl: slice, cfg: AlgorithmConfig):
    """Token-level PPO-clip; token-local, so any chunk `sl` of the tokens can be done alone."""
    log_ratio = (logprob - inputs.old_logprob[sl]).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    pg, clipped, lower = _ppo_clip(log_ratio, inputs.advantages[sl], cfg.clip_ratio_low, cfg.clip_ratio_high,
                                   cfg.clip_ratio_c)
    return pg, clipped, lower, log_ratio


def gspo_pg(logprob: Tensor, inputs: TokenLossInputs, sl: slice, cfg: AlgorithmConfig):
    """GSPO; `sl` must cover whole sequences (policy_loss passes all tokens)."""
    log_ratio = logprob - inputs.old_logprob[sl]
    _, inv = torch.unique(inputs.seq_index[sl], return_inverse=True)
    n = int(inv.max()) + 1 if inv.numel() else 0
    # Only tokens in the loss define a sequence's length and mean (padding has weight 0).
    in_loss = (inputs.token_weight[sl] != 0).to(log_ratio.dtype)
    lengths = log_ratio.new_zeros(n).index_add_(0, inv, in_loss).clamp(min=1)
    total = log_ratio.new_zeros(n).index_add_(0, inv, (log_ratio * in_loss).detach())
    seq_log_ratio = (total / lengths)[inv]
    # Value s_i, gradient s_i * d logprob_t; veRL clamps the log-ratio at 10 for stability.
    log_s = (logprob - logprob.detach() + seq_log_ratio).clamp(max=10.0)
    # GSPO's paper and veRL clip the sequence ratio plainly: no dual-clip.
    pg, clipped, lower = _ppo_clip(log_s, inputs.advantages[sl], cfg.clip_ratio_low, cfg.clip_ratio_high, None)
    return pg, clipped, lower, log_ratio


def _combine(pg_out: tuple, logprob: Tensor, entropy: Optional[Tensor], inputs: TokenLossInputs, sl: slice,
             cfg: AlgorithmConfig, entry: PolicyLoss) -> tuple[Tensor, dict[str, Tensor]]:
    """Add IS weights, KL and entropy to a policy loss's (pg, clipped, dual-clipped, log-ratio) and
    reduce to (weighted loss sum, weighted metric sums)."""
    pg, clipped, lower, log_ratio = pg_out
    w = inputs.token_weight[sl]
    # A token with no loss weight (padding, an overlong-filtered response) is out of the metrics too,
    # even if the caller filled metric_weight uniformly.
    mw = torch.where(w != 0, inputs.metric_weight[sl], torch.zeros_like(inputs.metric_weight[sl]))
    metrics = {}
    if cfg.tis_cap is not None:
        pg = pg * tis_weight(inputs.old_logprob[sl], inputs.rollout_logprob[sl], cfg.tis_cap)
        # How far the rollout policy is from pi_old (asynchronous rollout, engine numerics): the mean
        # importance ratio before the cap, and the fraction of tokens the cap truncated.
        log_r = (inputs.old_logprob[sl] - inputs.rollout_logprob[sl]).detach()
        metrics["actor/tis_ratio_mean"] = (mw * torch.exp(log_r.clamp(max=20.0))).sum()
        metrics["actor/tis_capped_frac"] = (mw * (log_r > math.log(cfg.tis_cap)).to(mw.dtype)).sum()
    loss = pg
    metrics.update({
        "actor/pg_loss": (w * pg).sum(),
        "actor/pg_clipfrac": (mw * clipped.to(mw.dtype)).sum(),
        "actor/ppo_kl": (mw * -log_ratio.detach()).sum(),
    })
    if cfg.clip_ratio_c is not None and entry.dual_clip:
        metrics["actor/pg_clipfrac_lower"] = (mw * lower.to(mw.dtype)).sum()
    if cfg.use_kl_loss:
        kl = kl_estimate(logprob, inputs.ref_logprob[sl], cfg.kl_loss_type)
        loss = loss + cfg.kl_coef * kl
        metrics["actor/kl_loss"] = (w * kl).sum()
    if entropy is not None:
        if cfg.entropy_coeff != 0.0:
            loss = loss - cfg.entropy_coeff * entropy
        metrics["actor/entropy"] = (w * entropy).sum()
    elif cfg.entropy_coeff != 0.0:
        raise ValueError("algorithm.entropy_coeff != 0 needs the entropy (compute_entropy=True)")
    return (w * loss).sum(), {k: v.detach() for k, v in metrics.items()}


def make_token_loss_fn(inputs: TokenLossInputs, cfg: AlgorithmConfig) -> TokenLossFn:
    """Bind a micro-batch's tensors into `token_loss_fn(logprob_chunk, entropy_chunk, sl)` for the
    chunked / fused log-prob kernels; `sl` selects the chunk's tokens in `inputs`."""
    entry = _check(inputs, cfg)
    if not entry.token_level:
        raise ValueError(f"algorithm.policy_loss={cfg.policy_loss!r} needs whole sequences (a sequence-level "
                         "ratio); compute log-probs first and call policy_loss(), not the chunked token loss")
    pg_fn = entry.load()

    def token_loss_fn(logprob: Tensor, entropy: Optional[Tensor], sl: slice):
        return _combine(pg_fn(logprob, inputs, sl, cfg), logprob, entropy, inputs, sl, cfg, entry)

    return token_loss_fn


def policy_loss(logprob: Tensor, entropy: Optional[Tensor], inputs: TokenLossInputs,
                cfg: AlgorithmConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, metrics) over all tokens of `inputs` at once; same numbers as the chunked path for
    token-level losses, and the only path for gspo."""
    entry = _check(inputs, cfg)
    sl = slice(0, len(inputs))
    return _combine(entry.load()(logprob, inputs, sl, cfg), logprob, entropy, inputs, sl, cfg, entry)

