"""The algorithm choices a config may name, and what each one is: the single list of them.

`mgrpo.preflight` and the trainer read these entries; the functions they name live in
advantages.py, policy_loss.py, kl.py and aggregation.py. This module imports no torch (the
validator runs inside the planner, which must not), so each entry names its function by a
'module:function' target that is imported on first use.

A new estimator / loss / KL estimator / aggregation mode is its function plus one entry here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from mgrpo.config.registry import Registry, load_target

_A = "mgrpo.algorithms."


@dataclass(frozen=True)
class _Target:
    target: str
    """'module:function' of the implementation."""

    def load(self) -> Callable:
        return load_target(self.target)


@dataclass(frozen=True)
class AdvantageEstimator(_Target):
    """fn(scores, group_index, response_mask, cfg, token_rewards) -> advantages [N, L]."""

    needs_groups: bool = True
    """Advantages are relative to the other responses of the same prompt, so rollout.n must be >= 2."""


@dataclass(frozen=True)
class PolicyLoss(_Target):
    """fn(logprob, inputs, sl, cfg) -> (per-token pg loss, clipped, dual-clipped, log-ratio) over tokens
    `sl`; the log-ratio log(pi/pi_old) is the one actor/ppo_kl reports (as the loss's veRL function does)."""

    token_level: bool = True
    """A token's loss depends on that token only, so the fused kernel may compute it chunk by chunk;
    False = it needs whole sequences (a sequence-level ratio): log-probs first, then the loss."""
    dual_clip: bool = False
    """Honours algorithm.clip_ratio_c (and reports actor/pg_clipfrac_lower)."""
    loss_agg_mode: Optional[str] = None
    """The aggregation its objective is defined with, overriding algorithm.loss_agg_mode (None = use it)."""


@dataclass(frozen=True)
class KLEstimator(_Target):
    """fn(logprob, ref_logprob) -> per-token KL(pi || pi_ref) estimate."""


@dataclass(frozen=True)
class AggregationMode(_Target):
    """fn(mask [N, L] float64, *, global_tokens, global_seqs, max_response_length) -> per-token weights."""


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry("algorithm.adv_estimator", {
    "grpo": AdvantageEstimator(_A + "advantages:grpo"),
    "dr_grpo": AdvantageEstimator(_A + "advantages:dr_grpo"),
    "rloo": AdvantageEstimator(_A + "advantages:rloo"),
    # Batch-whitened returns: no group baseline, so single responses per prompt are fine.
    "reinforce_plus_plus": AdvantageEstimator(_A + "advantages:reinforce_plus_plus", needs_groups=False),
    "reinforce_plus_plus_baseline": AdvantageEstimator(_A + "advantages:reinforce_plus_plus_baseline"),
    # No reward advantage: on-policy distillation's teacher term alone (algorithm.opd).
    "none": AdvantageEstimator(_A + "advantages:no_advantage", needs_groups=False),
})

POLICY_LOSSES: Registry[PolicyLoss] = Registry("algorithm.policy_loss", {
    "vanilla": PolicyLoss(_A + "policy_loss:vanilla_pg", token_level=True, dual_clip=True),
    # A sequence-level ratio; aggregated with algorithm.loss_agg_mode like veRL 0.9.1's GSPO (the paper's
    # seq-mean-token-mean is what configs/algorithm/gspo.yaml sets).
    "gspo": PolicyLoss(_A + "policy_loss:gspo_pg", token_level=False),
})

KL_ESTIMATORS: Registry[KLEstimator] = Registry("algorithm.kl_loss_type", {
    "k1": KLEstimator(_A + "kl:k1"),
    "k2": KLEstimator(_A + "kl:k2"),
    "k3": KLEstimator(_A + "kl:k3"),
    "low_var_kl": KLEstimator(_A + "kl:k3"),  # veRL's name for the same (clamped) k3
})

AGGREGATION_MODES: Registry[AggregationMode] = Registry("algorithm.loss_agg_mode", {
    "token-mean": AggregationMode(_A + "aggregation:token_mean"),
    "seq-mean-token-sum": AggregationMode(_A + "aggregation:seq_mean_token_sum"),
    "seq-mean-token-mean": AggregationMode(_A + "aggregation:seq_mean_token_mean"),
    "seq-mean-token-sum-norm": AggregationMode(_A + "aggregation:seq_mean_token_sum_norm"),
})
