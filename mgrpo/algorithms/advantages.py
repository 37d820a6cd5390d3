"""Advantage estimators of the GRPO family: one score per response in, one advantage per token out.

Every estimator takes the whole rollout batch at once (it runs on the driver, before the batch is
split across ranks), so group and batch statistics are exact and need no communication.

Outcome estimators (grpo, dr_grpo, rloo, reinforce_plus_plus_baseline) give every token of a
response the same advantage. reinforce_plus_plus works on token rewards (the score on the last
response token plus optional per-token KL penalties) and returns-to-go, so its advantage varies
along the response when KL-in-reward is on.

When `token_rewards` is given it is the whole reward signal and supersedes `scores`: outcome
estimators use its masked per-response sum, as veRL does (so a KL-in-reward penalty also lowers the
GRPO score). Left out on purpose: critics (GAE), ReMax and OPO, which need extra rollouts or values.
"""

from __future__ import annotations

import torch

from mgrpo.algorithms.registry import ADVANTAGE_ESTIMATORS
from mgrpo.config.schema import AlgorithmConfig

Tensor = torch.Tensor

EPS = 1e-6  # added to the group std (veRL's epsilon): a group of equal scores gets advantage 0, not nan


def scores_to_token_rewards(scores: Tensor, response_mask: Tensor) -> Tensor:
    """[N] scores -> [N, L] rewards with each score on its response's last token (0 elsewhere).

    A response with no tokens gets no reward (its row is all zero).
    """
    mask = response_mask.to(torch.float32)
    lengths = mask.sum(-1).long()
    rewards = torch.zeros_like(mask)
    rows = torch.nonzero(lengths > 0).squeeze(-1)
    # The last response token is the last position where the mask is 1 (masks may not start at 0).
    last = (mask * torch.arange(mask.shape[1], dtype=mask.dtype, device=mask.device)).argmax(-1)
    rewards[rows, last[rows]] = scores.to(torch.float32)[rows]
    return rewards


def group_stats(scores: Tensor, group_index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample (group mean, unbiased group std, group size), vectorised with index_add.

    Groups of one sample get mean 0 and std 1 (so their advantage is the raw score), as in veRL.
    """
    scores = scores.to(torch.float64)  # sums of many small rewards: keep the statistics exact
    _, inv = torch.unique(group_index, return_inverse=True)
    inv = inv.to(scores.device)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = scores.new_zeros(n_groups).index_add_(0, inv, torch.ones_like(scores))
    total = scores.new_zeros(n_groups).index_add_(0, inv, scores)
    mean = total / count
    sq = scores.new_zeros(n_groups).index_add_(0, inv, (scores - mean[inv]) ** 2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    single = count == 1
    mean = torch.where(single, torch.zeros_like(mean), mean)
    std = torch.where(single, torch.ones_like(std), std)
    return mean[inv], std[inv], count[inv]


def masked_whiten(values: Tensor, mask: Tensor) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the tokens where mask is 1, with the unbiased variance
    (veRL's `masked_whiten`). Statistics are over tokens, so longer responses weigh more."""
    m = mask.to(values.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError(f"batch whitening needs at least 2 response tokens, got {int(n)}")
    mean = (values * m).sum() / n
    var = (((values - mean) ** 2) * m).sum() / (n - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


def _outcome(adv: Tensor, response_mask: Tensor) -> Tensor:
    return adv.to(torch.float32).unsqueeze(-1) * response_mask.to(torch.float32)


def grpo(scores, group_index, response_mask, cfg, token_rewards=None):
    """(s - mean_g) / (std_g + eps); with norm_adv_by_std_in_grpo=False just s - mean_g."""
    mean, std, _ = group_stats(scores, group_index)
    adv = scores.to(torch.float64) - mean
    if cfg.norm_adv_by_std_in_grpo:
        adv = adv / (std + EPS)
    return _outcome(adv, response_mask)


def dr_grpo(scores, group_index, response_mask, cfg, token_rewards=None):
    """Dr. GRPO (Liu et al. 2025): no std division, which biases towards too easy/hard prompts.
    Its other half, the length-unbiased aggregation, is loss_agg_mode=seq-mean-token-sum-norm."""
    mean, _, _ = group_stats(scores, group_index)
    return _outcome(scores.to(torch.float64) - mean, response_mask)


def rloo(scores, group_index, response_mask, cfg, token_rewards=None):
    """Leave-one-out baseline: s_i - mean of the other n-1 scores = n/(n-1) * (s_i - mean_g)."""
    mean, _, count = group_stats(scores, group_index)
    s = scores.to(torch.float64)
    adv = torch.where(count > 1, (s - mean) * count / (count - 1).clamp(min=1), s)
    return _outcome(adv, response_mask)


def reinforce_plus_plus(scores, group_index, response_mask, cfg, token_rewards=None):
    """REINFORCE++ (Hu 2025): returns-to-go (gamma = 1) of the token rewards, whitened over the
    batch. Without KL-in-reward every token's return is the score, so this is batch-whitened score."""
    mask = response_mask.to(torch.float64)
    rewards = token_rewards if token_rewards is not None else scores_to_token_rewards(scores, response_mask)
    rewards = rewards.to(torch.float64) * mask
    returns = rewards.flip(-1).cumsum(-1).flip(-1)  # sum_{t' >= t} r_t'  (gamma = 1)
    return (masked_whiten(returns, mask) * mask).to(torch.float32)


def reinforce_plus_plus_baseline(scores, group_index, response_mask, cfg, token_rewards=None):
    """REINFORCE++ with a group-mean baseline, then batch whitening over tokens."""
    mean, _, _ = group_stats(scores, group_index)
    mask = response_mask.to(torch.float64)
    adv = (scores.to(torch.float64) - mean).unsqueeze(-1) * mask
    return (masked_whiten(adv, mask) * mask).to(torch.float32)


def compute_advantages(scores: Tensor, group_index: Tensor, response_mask: Tensor, cfg: AlgorithmConfig,
                       token_rewards: Tensor | None = None) -> Tensor:
    """Advantages [N, L] (float32, zero where response_mask is 0) with cfg.adv_estimator.

    scores [N]: one reward per response. group_index [N] (long): responses with the same value were
    sampled from the same prompt (use the prompt's position in the batch, not a dataset id, since a
    small dataset may repeat a prompt within one batch). token_rewards [N, L]: see module docstring.
    The estimators are registered in registry.py.
    """
    fn = ADVANTAGE_ESTIMATORS.lookup(cfg.adv_estimator).load()
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be [N] and response_mask [N, L]; got {tuple(scores.shape)} and "
                         f"{tuple(response_mask.shape)}")
    if group_index.shape != scores.shape:
        raise ValueError(f"group_index must be [N]={tuple(scores.shape)}, got {tuple(group_index.shape)}")
    if token_rewards is not None:
        if token_rewards.shape != response_mask.shape:
            raise ValueError(f"token_rewards must be [N, L]={tuple(response_mask.shape)}, "
                             f"got {tuple(token_rewards.shape)}")
        scores = (token_rewards.to(torch.float64) * response_mask.to(torch.float64)).sum(-1)
    with torch.no_grad():
        return fn(scores, group_index, response_mask, cfg, token_rewards)
