"""Top-k log-probs over a (vocab-parallel) output layer, and log-probs of given ids per token: on-policy
distillation's forward_kl_topk (the teacher's k likeliest tokens at every position, the student's log-probs of
those same tokens).

`linear_topk` never holds more than one chunk of tokens' logits over this rank's vocabulary shard: per chunk it
takes the shard's log-sum-exp and its k largest logits; under tensor parallelism the shards' (lse, top-k) are
all-gathered (k + 1 numbers per token and rank, never the vocabulary) and merged, the global lse subtracted.
Forward only: the teacher is frozen.

`linear_ids_logprobs` gives each token the log-probs of k ids of its own, differentiable: the same kernel as the
sampled token's log-prob (`dispatch.linear_logprobs`), run over the token's hidden state repeated k times, so it
shares its memory bound (a chunk of logits) and its TP algebra. What was left out: one pass for all k ids (the
log-sum-exp once, k gathered rows); this costs k passes over the output layer instead of one.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .chunked import DEFAULT_CHUNK_SIZE, num_valid_rows


@torch.no_grad()
def linear_topk(hidden: torch.Tensor, weight: torch.Tensor, k: int, *, temperature: float = 1.0,
                chunk_size: int = DEFAULT_CHUNK_SIZE, tp_group: Optional[dist.ProcessGroup] = None,
                vocab_start: int = 0, vocab_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs [T, k] fp32, highest first; ids [T, k] int64, global) of the k likeliest tokens under
    softmax(hidden @ weight.T / temperature) over the real vocabulary. `weight` is this rank's vocabulary
    shard (rows [vocab_start, vocab_start + V_local)) when `tp_group` is given; rows at or past `vocab_size`
    are padding and never chosen."""
    t = hidden.shape[0]
    valid = num_valid_rows(weight.shape[0], vocab_start, vocab_size)
    world = 1 if tp_group is None else dist.get_world_size(tp_group)
    total = valid if world == 1 else None
    if total is not None and k > total:
        raise ValueError(f"top-{k} of a vocabulary of {total} tokens")
    out_lp = torch.empty((t, k), dtype=torch.float32, device=hidden.device)
    out_id = torch.empty((t, k), dtype=torch.long, device=hidden.device)
    w = weight[:valid]
    for lo in range(0, t, chunk_size):
        hi = min(lo + chunk_size, t)
        z = (hidden[lo:hi] @ w.T).float() / temperature  # one chunk of this shard's logits
        kk = min(k, valid)
        lse = torch.logsumexp(z, -1) if valid else torch.full((hi - lo,), -torch.inf, device=z.device)
        vals, ids = z.topk(kk, -1) if kk else (z.new_empty((hi - lo, 0)), torch.empty((hi - lo, 0), dtype=torch.long, device=z.device))
        ids = ids + vocab_start
        if world > 1:  # every shard's k best and its lse; the merged k best and the global lse
            pad = k - kk  # a shard with fewer than k real rows pads with -inf (never chosen)
            vals = torch.cat([vals, vals.new_full((hi - lo, pad), -torch.inf)], -1)
            ids = torch.cat([ids, ids.new_zeros((hi - lo, pad))], -1)
            packed = torch.cat([vals, lse[:, None]], -1).contiguous()
            got_v = [torch.empty_like(packed) for _ in range(world)]
            got_i = [torch.empty_like(ids) for _ in range(world)]
            dist.all_gather(got_v, packed, group=tp_group)
            dist.all_gather(got_i, ids.contiguous(), group=tp_group)
            lse = torch.logsumexp(torch.stack([g[:, -1] for g in got_v], -1), -1)
            cand_v = torch.cat([g[:, :-1] for g in got_v], -1)
            best_v, at = cand_v.topk(k, -1)
            vals, ids = best_v, torch.cat(got_i, -1).gather(-1, at)
        out_lp[lo:hi] = vals - lse[:, None]
        out_id[lo:hi] = ids
    return out_lp, out_id


def linear_ids_logprobs(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, **kernel) -> torch.Tensor:
    """[T, k] fp32 log-probs of ids [T, k] (global) at each token, differentiable w.r.t. hidden and weight;
    `kernel`: `dispatch.linear_logprobs`'s keyword arguments (temperature, impl, chunk_size, tp_group, vocab_start,
    vocab_size; no sampling supports: the ids are the whole vocabulary's)."""
    from .dispatch import linear_logprobs

    t, k = ids.shape
    if t == 0:
        return hidden.new_zeros((0, k), dtype=torch.float32) + 0.0 * hidden.sum()
    lp, _ = linear_logprobs(hidden.repeat_interleave(k, 0), weight, ids.reshape(-1), compute_entropy=False,
                            **kernel)
    return lp.view(t, k)
