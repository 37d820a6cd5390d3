"""Drawing one token per row from a [rows x vocab] distribution on CPU, fast at Qwen3's vocabulary.

`torch.multinomial(probs, 1)` (what transformers' `generate` and SGLang's torch sampler call) draws with
the exponential race, argmax(probs / q) with q ~ Exp(1) for every entry: on CPU torch makes each of the
rows x vocab exponentials one at a time, 48 ms for 16 rows of 151,936 (benchmarks/measure/sampler.py), and
a decode step of the Qwen3-vocabulary benchmark model takes about 45 ms besides. `sample_categorical`
draws from the same distribution by inversion with one uniform per row, on two levels so that the
cumulative sums stay short and exact in float64: the block of 128 entries the uniform falls in, then the
entry inside that block (about 1 ms for the same rows). A vocabulary of one block (the tiny job's 16 tokens)
takes the inner level alone: 0.05 ms for 256 rows, where padding it to a block and going through both levels
took 0.2 ms, four of them in each tiny `generate`.

The readable reference is `torch.multinomial`; tests/rollout/test_categorical.py checks the draws against the
exact probabilities (chi-square) and against it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

BLOCK = 128
"""Entries per block: vocabularies are padded to a multiple of 128 (Megatron's make_vocab_size_divisible_by),
so Qwen3's 151,936 splits into 1,187 blocks with no copy."""


def _last_positive(weights: torch.Tensor) -> torch.Tensor:
    """[n, 1]: per row the index of the last entry > 0 (the row's total is checked positive first)."""
    idx = torch.arange(weights.shape[-1]).expand_as(weights)
    return torch.where(weights > 0, idx, -1).amax(-1, keepdim=True)


def sample_categorical(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[n, 1] int64: per row an index drawn with probability probs[i, j] / probs[i].sum().

    `probs`: [n, vocab], non-negative, any scale (softmax output, or with entries zeroed by top-k / top-p).
    An entry of weight 0 is never drawn. A row whose total is 0, inf or NaN (what a model gives when its
    weights have gone bad) or one of whose blocks sums below 0 raises, as torch.multinomial does, instead of
    drawing something; single negative entries are not looked for (softmax makes none). Random numbers come
    from `generator` (torch's default one when None), one per row.
    """
    if probs.dim() != 2:
        raise ValueError(f"sample_categorical takes [rows, vocab] weights, not shape {tuple(probs.shape)}")
    n, v = probs.shape
    if v <= BLOCK:  # one block (the tiny job's 16 entries): the inner level alone, no padding (0.05 ms, not 0.2)
        total = probs.sum(-1, keepdim=True).double()
        _check(total, total)
        return within(probs, torch.rand((n, 1), dtype=torch.float64, generator=generator) * total)
    nb = -(-v // BLOCK)
    padded = F.pad(probs, (0, nb * BLOCK - v)) if nb * BLOCK != v else probs
    blocks = padded.reshape(n, nb, BLOCK)
    # A block's sum in the weights' dtype (float32: relative error ~1e-7, the precision the softmax that made
    # them has; in float64 the sum alone cost 3.3 of the 4 ms), the running sums over blocks in float64.
    sums = blocks.sum(-1).double()  # [n, nb]
    cum = sums.cumsum(-1)
    _check(cum[:, -1:], sums)
    return invert(blocks, torch.rand((n, 1), dtype=torch.float64, generator=generator), sums, cum)


def _check(total: torch.Tensor, sums: torch.Tensor) -> None:
    if not bool(torch.isfinite(total).all() and (total > 0).all() and (sums >= 0).all()):
        raise ValueError("sample_categorical: a row's weights are not a distribution (inf, NaN, negative or all "
                         "zero)")


def within(weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """[n, 1]: per row the entry of `weights` ([n, k]) whose cumulative weight (float64) first passes `target`
    ([n, 1] float64, in [0, the row's total]); a target rounded up to the total gives the last entry with weight."""
    j = torch.searchsorted(weights.cumsum(-1, dtype=torch.float64), target, right=True)
    return torch.minimum(j, _last_positive(weights))


def invert(blocks: torch.Tensor, u: torch.Tensor, sums: torch.Tensor, cum: torch.Tensor) -> torch.Tensor:
    """[n, 1]: per row the entry whose cumulative weight first passes u * total (u in [0, 1), [n, 1] float64).
    `blocks`: the weights as [n, blocks, BLOCK]; `sums`, `cum`: their float64 block sums and cumulative sums."""
    n = blocks.shape[0]
    u = u * cum[:, -1:]
    # The block holds the first cumulative sum past u. A block of weight 0 repeats its predecessor's sum,
    # so `right=True` never lands on one; u rounded up to the total lands past the end: the last block
    # with weight takes it.
    k = torch.minimum(torch.searchsorted(cum, u, right=True), _last_positive(sums))
    below = torch.where(k > 0, cum.gather(1, (k - 1).clamp(min=0)), torch.zeros_like(u))  # mass before block k
    inner = blocks.gather(1, k[:, :, None].expand(n, 1, BLOCK)).squeeze(1)  # [n, BLOCK]
    return k * BLOCK + within(inner, u - below)
