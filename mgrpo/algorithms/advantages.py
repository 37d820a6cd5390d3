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

numpy, not torch: this is the driver's bookkeeping, and the driver never imports torch (~136 MiB of
its memory). Statistics in float64, results in float32 (what the trainer ranks receive).
"""

from __future__ import annotations

import numpy as np

from mgrpo.algorithms.registry import ADVANTAGE_ESTIMATORS
from mgrpo.config.schema import AlgorithmConfig

EPS = 1e-6  # added to the group std (veRL's epsilon): a group of equal scores gets advantage 0, not nan


def scores_to_token_rewards(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """[N] scores -> [N, L] rewards with each score on its response's last token (0 elsewhere).

    A response with no tokens gets no reward (its row is all zero).
    """
    mask = np.asarray(response_mask, dtype=np.float32)
    rewards = np.zeros_like(mask)
    rows = np.flatnonzero(mask.sum(-1) > 0)
    # The last response token is the last position where the mask is 1 (masks may not start at 0).
    last = (mask * np.arange(mask.shape[1], dtype=np.float32)).argmax(-1)
    rewards[rows, last[rows]] = np.asarray(scores, dtype=np.float32)[rows]
    return rewards


def group_stats(scores: np.ndarray, group_index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-sample (group mean, unbiased group std, group size), vectorised with bincount.

    Groups of one sample get mean 0 and std 1 (so their advantage is the raw score), as in veRL.
    """
    scores = np.asarray(scores, dtype=np.float64)  # sums of many small rewards: keep the statistics exact
    _, inv = np.unique(np.asarray(group_index), return_inverse=True)
    inv = inv.reshape(-1)
    n_groups = int(inv.max()) + 1 if inv.size else 0
    count = np.bincount(inv, minlength=n_groups).astype(np.float64)
    mean = np.bincount(inv, weights=scores, minlength=n_groups) / np.maximum(count, 1)
    sq = np.bincount(inv, weights=(scores - mean[inv]) ** 2, minlength=n_groups)
    std = np.sqrt(sq / np.maximum(count - 1, 1))
    single = count == 1
    mean = np.where(single, 0.0, mean)
    std = np.where(single, 1.0, std)
    return mean[inv], std[inv], count[inv]


def masked_whiten(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(x - mean) / sqrt(var + 1e-8) over the tokens where mask is 1, with the unbiased variance
    (veRL's `masked_whiten`). Statistics are over tokens, so longer responses weigh more."""
    m = np.asarray(mask, dtype=values.dtype)
    n = m.sum()
    if n < 2:
        raise ValueError(f"batch whitening needs at least 2 response tokens, got {int(n)}")
    mean = (values * m).sum() / n
    var = (((values - mean) ** 2) * m).sum() / (n - 1)
    return (values - mean) / np.sqrt(var + 1e-8)


def _outcome(adv: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    return adv.astype(np.float32)[:, None] * np.asarray(response_mask, dtype=np.float32)


def grpo(scores, group_index, response_mask, cfg, token_rewards=None):
    """(s - mean_g) / (std_g + eps); with norm_adv_by_std_in_grpo=False just s - mean_g."""
    mean, std, _ = group_stats(scores, group_index)
    adv = np.asarray(scores, dtype=np.float64) - mean
    if cfg.norm_adv_by_std_in_grpo:
        adv = adv / (std + EPS)
    return _outcome(adv, response_mask)


def dr_grpo(scores, group_index, response_mask, cfg, token_rewards=None):
    """Dr. GRPO (Liu et al. 2025): no std division, which biases towards too easy/hard prompts.
    Its other half, the length-unbiased aggregation, is loss_agg_mode=seq-mean-token-sum-norm."""
    mean, _, _ = group_stats(scores, group_index)
    return _outcome(np.asarray(scores, dtype=np.float64) - mean, response_mask)


def rloo(scores, group_index, response_mask, cfg, token_rewards=None):
    """Leave-one-out baseline: s_i - mean of the other n-1 scores = n/(n-1) * (s_i - mean_g)."""
    mean, _, count = group_stats(scores, group_index)
    s = np.asarray(scores, dtype=np.float64)
    adv = np.where(count > 1, (s - mean) * count / np.maximum(count - 1, 1), s)
    return _outcome(adv, response_mask)


def reinforce_plus_plus(scores, group_index, response_mask, cfg, token_rewards=None):
    """REINFORCE++ (Hu 2025): returns-to-go (gamma = 1) of the token rewards, whitened over the
    batch. Without KL-in-reward every token's return is the score, so this is batch-whitened score."""
    mask = np.asarray(response_mask, dtype=np.float64)
    rewards = token_rewards if token_rewards is not None else scores_to_token_rewards(scores, response_mask)
    rewards = np.asarray(rewards, dtype=np.float64) * mask
    returns = np.cumsum(rewards[:, ::-1], -1)[:, ::-1]  # sum_{t' >= t} r_t'  (gamma = 1)
    return (masked_whiten(returns, mask) * mask).astype(np.float32)


def reinforce_plus_plus_baseline(scores, group_index, response_mask, cfg, token_rewards=None):
    """REINFORCE++ with a group-mean baseline, then batch whitening over tokens."""
    mean, _, _ = group_stats(scores, group_index)
    mask = np.asarray(response_mask, dtype=np.float64)
    adv = (np.asarray(scores, dtype=np.float64) - mean)[:, None] * mask
    return (masked_whiten(adv, mask) * mask).astype(np.float32)


def no_advantage(scores, group_index, response_mask, cfg, token_rewards=None):
    """Zero everywhere: the reward moves nothing (pure on-policy distillation, whose teacher term is added
    afterwards, `mgrpo/algorithms/distill.py`)."""
    return np.zeros(np.shape(response_mask), dtype=np.float32)


def compute_advantages(scores: np.ndarray, group_index: np.ndarray, response_mask: np.ndarray,
                       cfg: AlgorithmConfig, token_rewards: np.ndarray | None = None) -> np.ndarray:
    """Advantages [N, L] (float32, zero where response_mask is 0) with cfg.adv_estimator.

    scores [N]: one reward per response. group_index [N] (int): responses with the same value were
    sampled from the same prompt (use the prompt's position in the batch, not a dataset id, since a
    small dataset may repeat a prompt within one batch). token_rewards [N, L]: see module docstring.
    Array-likes (numpy arrays, lists) are taken as numpy arrays. The estimators are registered in registry.py.
    """
    fn = ADVANTAGE_ESTIMATORS.lookup(cfg.adv_estimator).load()
    scores, group_index, response_mask = np.asarray(scores), np.asarray(group_index), np.asarray(response_mask)
    if scores.ndim != 1 or response_mask.ndim != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be [N] and response_mask [N, L]; got {tuple(scores.shape)} and "
                         f"{tuple(response_mask.shape)}")
    if group_index.shape != scores.shape:
        raise ValueError(f"group_index must be [N]={tuple(scores.shape)}, got {tuple(group_index.shape)}")
    if token_rewards is not None:
        token_rewards = np.asarray(token_rewards)
        if token_rewards.shape != response_mask.shape:
            raise ValueError(f"token_rewards must be [N, L]={tuple(response_mask.shape)}, "
                             f"got {tuple(token_rewards.shape)}")
        scores = (token_rewards.astype(np.float64) * response_mask.astype(np.float64)).sum(-1)
    return fn(scores, group_index, response_mask, cfg, token_rewards)
