"""Loss aggregation as per-token weights normalised over the GLOBAL mini-batch.

Every aggregation mode is a weighted sum of per-token losses, loss = sum_t w_t * l_t, once the
normalisers are fixed constants of the global mini-batch (all micro-batches on all data-parallel
ranks of one optimizer step). Computing w_t up front, on the driver, makes the loss a plain sum, so:
  - a micro-batch contributes sum over its tokens of w_t * l_t, and gradients simply accumulate;
  - data-parallel ranks all-reduce with SUM (not mean: the 1/N is already inside w_t);
  - the chunked loss kernel can process any slice of tokens independently.
The gradient is then the same for any micro-batch size, number of micro-batches or DP size.
(The usual per-micro-batch mean followed by averaging micro-batches is not: it weights a token by
1/(tokens in its micro-batch), which depends on how the batch was cut.)

Modes, with N_tok the global number of response tokens, N_seq the global number of responses that
have at least one token in the loss, |y_i| the length of response i and L_max the max response length:
  token-mean               w = 1 / N_tok                          (DAPO; every token counts equally)
  seq-mean-token-sum       w = 1 / N_seq                          (sum over a response, mean over responses)
  seq-mean-token-mean      w = 1 / (N_seq * |y_i|)                (original GRPO)
  seq-mean-token-sum-norm  w = 1 / (N_seq * L_max)                (Dr. GRPO: a constant length divisor)
For seq-mean-token-sum-norm veRL 0.9.1's `agg_loss` takes the mean over responses of the token sums
(1/N_seq included, N_seq the global number of responses with a token in the loss) and divides it by a
constant, `actor.loss_scale_factor`, which defaults to the (padded) max response length; L_max is that
constant. This is Dr. GRPO's written objective, (1/G) sum_i sum_t l_it / L_max.

numpy, not torch: the weights are computed on the driver, which never imports torch; they travel
to the ranks as per-sample lists.
"""

from __future__ import annotations

import numpy as np

from mgrpo.algorithms.registry import AGGREGATION_MODES, POLICY_LOSSES
from mgrpo.config.schema import AlgorithmConfig

def global_counts(response_mask: np.ndarray) -> tuple[int, int]:
    """(global_tokens, global_seqs) of a whole mini-batch: tokens in the loss, and responses with at
    least one such token (fully masked responses, e.g. overlong-filtered ones, do not count)."""
    m = np.asarray(response_mask).astype(bool)
    return int(m.sum()), int(m.any(-1).sum())


def effective_loss_agg_mode(cfg: AlgorithmConfig) -> str:
    """The mode the weights must be computed with: the policy loss's own when its registry entry
    defines one, else algorithm.loss_agg_mode (every registered loss, GSPO included as in veRL 0.9.1)."""
    return POLICY_LOSSES.lookup(cfg.policy_loss).loss_agg_mode or cfg.loss_agg_mode


# The modes registered in registry.AGGREGATION_MODES; m is the float64 mask.
def token_mean(m: np.ndarray, *, global_tokens: int, global_seqs: int, max_response_length: int) -> np.ndarray:
    return m / max(global_tokens, 1)


def seq_mean_token_sum(m: np.ndarray, *, global_tokens: int, global_seqs: int, max_response_length: int) -> np.ndarray:
    return m / max(global_seqs, 1)


def seq_mean_token_mean(m: np.ndarray, *, global_tokens: int, global_seqs: int, max_response_length: int) -> np.ndarray:
    lengths = np.maximum(m.sum(-1, keepdims=True), 1)
    return m / (lengths * max(global_seqs, 1))


def seq_mean_token_sum_norm(m: np.ndarray, *, global_tokens: int, global_seqs: int,
                            max_response_length: int) -> np.ndarray:
    return m / (max(global_seqs, 1) * max_response_length)


def token_weights(response_mask: np.ndarray, mode: str, *, global_tokens: int, global_seqs: int,
                  max_response_length: int) -> np.ndarray:
    """Per-token weights [N, L] (float32, 0 where the mask is 0) for any slice of the global batch.

    `response_mask` may be the whole mini-batch or any subset of its rows (a micro-batch, one rank's
    share); the global counts come from `global_counts` over the whole mini-batch.
    """
    fn = AGGREGATION_MODES.lookup(mode).load()
    w = fn(np.asarray(response_mask, dtype=np.float64), global_tokens=global_tokens, global_seqs=global_seqs,
           max_response_length=max_response_length)
    return w.astype(np.float32)


def metric_weights(response_mask: np.ndarray, *, global_tokens: int) -> np.ndarray:
    """1 / global_tokens on each response token: weights for token-mean metrics (clipfrac, ppo_kl)."""
    return np.asarray(response_mask, dtype=np.float32) / max(global_tokens, 1)
