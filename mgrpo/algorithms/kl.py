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

One definition for two array kinds: the estimators use only arithmetic, `.clip` and `_exp`, so the rank's loss
calls them on torch tensors (autograd) and the driver's KL-in-reward on numpy arrays, which keeps torch out
of the driver. This module imports no torch.
"""

from __future__ import annotations

import numpy as np

from mgrpo.algorithms.registry import KL_ESTIMATORS


def _exp(x):
    """exp of a numpy array, or of a torch tensor through its own method (autograd intact)."""
    return np.exp(x) if isinstance(x, np.ndarray) else x.exp()


def k1(logprob, ref_logprob):
    return logprob - ref_logprob


def k2(logprob, ref_logprob):
    d = logprob - ref_logprob
    return 0.5 * (d * d)


def k3(logprob, ref_logprob):
    r = (ref_logprob - logprob).clip(-20.0, 20.0)  # exp(20) ~ 5e8: no overflow
    return (_exp(r) - r - 1.0).clip(-10.0, 10.0)


def kl_estimate(logprob, ref_logprob, kind: str):
    """Elementwise KL estimate (same shape as the inputs); differentiable w.r.t. `logprob`.
    `kind` is a name registered in registry.KL_ESTIMATORS."""
    entry = KL_ESTIMATORS.get(kind)
    if entry is None:
        raise ValueError(f"unknown KL estimator {kind!r}; known: {list(KL_ESTIMATORS)}")
    return entry.load()(logprob, ref_logprob)


def apply_kl_in_reward(token_rewards: np.ndarray, logprob: np.ndarray, ref_logprob: np.ndarray,
                       mask: np.ndarray, kl_coef: float, kind: str) -> np.ndarray:
    """Token rewards minus a KL penalty on every response token: r_t - kl_coef * KL_t (veRL's
    `use_kl_in_reward`). All tensors [N, L]; positions where `mask` is 0 are left untouched.

    `logprob` is the policy that sampled the responses (the old policy), so the result is a constant
    of the update: numpy arrays on the driver, in float32 as the trainer's log-probs are.
    """
    kl = kl_estimate(np.asarray(logprob, dtype=np.float32), np.asarray(ref_logprob, dtype=np.float32), kind)
    return np.asarray(token_rewards, dtype=np.float32) - np.float32(kl_coef) * kl * np.asarray(mask, dtype=np.float32)
