"""Per-token KL estimators between the policy and the frozen reference, from sampled tokens only.

We never see the full distributions, only log pi(y_t) and log pi_ref(y_t) of the sampled token, so
KL(pi || pi_ref) is estimated per token (J. Schulman, "Approximating KL divergence", 2020), with
r = log pi_ref(y_t) - log pi(y_t) and y_t ~ pi:

    k1 = -r                 unbiased, high variance, can be negative
    k2 = r^2 / 2            biased, low variance; its gradient is the gradient of the true KL
    k3 = exp(r) - r - 1     unbiased, low variance, never negative
    low_var_kl              another name for k3

As in veRL (whose `k3` and `low_var_kl` are the same function), k3 is made safe for training: r is
clamped to [-20, 20] before exp and the estimate to [-10, 10], so one far-off-policy token cannot
dominate the batch. The clamps engage only where pi_ref/pi on a token exceeds ~13 (r > 2.6) or
pi/pi_ref exceeds e^11 (r < -11). These are the only definitions: the fused kernels take the token
loss (`policy_loss.make_token_loss_fn`) that calls them.
"""

from __future__ import annotations

import torch

from mgrpo.algorithms.registry import KL_ESTIMATORS

Tensor = torch.Tensor


def k1(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return logprob - ref_logprob


def k2(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    return 0.5 * (logprob - ref_logprob).square()


def k3(logprob: Tensor, ref_logprob: Tensor) -> Tensor:
    r = (ref_logprob - logprob).clamp(-20.0, 20.0)  # exp(20) ~ 5e8: no overflow
    return (torch.exp(r) - r - 1.0).clamp(-10.0, 10.0)


def kl_estimate(logprob: Tensor, ref_logprob: Tensor, kind: str) -> Tensor:
    """Elementwise KL estimate (same shape as the inputs); differentiable w.r.t. `logprob`.
    `kind` is a name registered in registry.KL_ESTIMATORS."""
    entry = KL_ESTIMATORS.get(kind)
    if entry is None:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {list(KL_ESTIMATORS)}")
    return entry.load()(logprob, ref_logprob)


def apply_kl_in_reward(token_rewards: Tensor, logprob: Tensor, ref_logprob: Tensor, mask: Tensor,
                       kl_coef: float, kind: str) -> Tensor:
    """Token rewards minus a KL penalty on every response token: r_t - kl_coef * KL_t (veRL's
    `use_kl_in_reward`). All tensors [N, L]; positions where `mask` is 0 are left untouched.

    `logprob` is the policy that sampled the responses (the old policy), so the result is a constant
    of the update: it is computed under no_grad.
    """
    with torch.no_grad():
        kl = kl_estimate(logprob.float(), ref_logprob.float(), kind)
        return token_rewards - kl_coef * kl * mask.to(kl.dtype)
