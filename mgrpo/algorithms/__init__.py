"""Advantages, policy losses, KL estimators and loss aggregation: pure torch, no process groups.

Everything here sees whole tensors handed to it by the trainer; nothing communicates. Normalisation
over the global batch is carried by per-token weights (aggregation.py), so the trainer only needs
to SUM losses and gradients across micro-batches and data-parallel ranks.
"""

from mgrpo.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    group_stats,
    masked_whiten,
    scores_to_token_rewards,
)
from mgrpo.algorithms.aggregation import (
    AGGREGATION_MODES,
    effective_loss_agg_mode,
    global_counts,
    metric_weights,
    token_weights,
)
from mgrpo.algorithms.filtering import (
    GroupAccumulator,
    apply_overlong_buffer,
    groups_with_signal,
    overlong_filter,
    overlong_penalty,
)
from mgrpo.algorithms.kl import KL_ESTIMATORS, apply_kl_in_reward, kl_estimate
from mgrpo.algorithms.policy_loss import (
    POLICY_LOSSES,
    TOKEN_LEVEL_LOSSES,
    TokenLossInputs,
    make_token_loss_fn,
    policy_loss,
    tis_weight,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATION_MODES", "KL_ESTIMATORS", "POLICY_LOSSES", "TOKEN_LEVEL_LOSSES",
    "GroupAccumulator", "TokenLossInputs", "apply_kl_in_reward", "apply_overlong_buffer", "compute_advantages",
    "effective_loss_agg_mode", "global_counts", "group_stats", "groups_with_signal", "kl_estimate",
    "make_token_loss_fn", "masked_whiten", "metric_weights", "overlong_filter", "overlong_penalty",
    "policy_loss", "scores_to_token_rewards", "tis_weight", "token_weights",
]
