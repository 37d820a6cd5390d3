"""Per-token sampling supports for the log-prob kernels: validation, and which columns a chunk needs.

With top-k / top-p the rollout engine samples each token from a truncated, renormalised distribution;
the policy that produced the token is softmax over that token's support S_t, so its log-prob is
z_y - logsumexp_{k in S_t} z_k and its entropy is taken over S_t (z = logits / temperature). A support
is given in CSR form: `support_offsets` [T+1] and `support_ids` [nnz], GLOBAL vocabulary ids; token t's
support is support_ids[support_offsets[t]:support_offsets[t+1]]. An empty row means the whole
vocabulary (the token was sampled from all of it): that token is normalised exactly as without supports.

How the chunked and Triton paths compute over supports: per chunk of tokens, the union U of their
supports that falls in this rank's vocabulary shard is the set of columns the chunk needs; only the
rows W[U] of the output layer are multiplied (gathered tile by tile), and a column outside a token's own
support gets the logit NEG, so it drops out of the softmax, the entropy and the gradient. Why this and
not per-token gathers or a vocabulary-wide mask:
  - top_k <= ~50 over V = 151,936: U of a 512-token chunk has at most 25,600 ids (in practice fewer:
    neighbouring tokens share candidates), so the GEMM shrinks by 6x or more and stays a GEMM (one
    weight row serves every token of the chunk that has it). A per-token gather of k rows would be a
    memory-bound batch of k x H dot products per token instead, fine for k = 50 but 100x slower than the
    GEMM it replaces once top-p nuclei reach thousands of tokens.
  - top-p nuclei can be large (a flat distribution at top_p = 0.9 keeps most of the vocabulary): U then
    approaches the whole shard, and when it covers more than half of it (or any token of the chunk is
    'full') the chunk simply runs over every row, contiguous and ungathered: the GEMMs are the full
    path's, plus O(nnz) bookkeeping (a scatter of the ids, the label check).
  Measured (benchmarks/peers/kernel_bench.py --support, chunked fused loss fwd+bwd, T=1024, H=1024, V=151,936, fp32,
  2 CPU cores, random ids, the worst case for the union): full vocabulary 5.7 s / 594 MiB peak; top_k=50
  1.3 s / 594 MiB; a 30% nucleus (45,580 ids a token, 47M in all) 7.9 s / 1,246 MiB
  (benchmarks/results/kernel_support_cpu.csv).
  - Nothing is [T x V]: a chunk's membership is one [chunk x columns] boolean matrix (at most
    chunk x V_local bytes, a quarter of the fp32 logits the fused path keeps for the same chunk), built
    by one scatter of the chunk's ids, no sort; tiles read slices of it.
Under tensor parallelism each rank takes the ids inside its shard; a token may have none there (its
statistics are then empty and merge to nothing), and the partial statistics merge across the TP group
exactly as the full path's (`chunked.merge_stats`).

NEG rather than -inf: a tile where a token has no support column would give exp(-inf - (-inf)) = nan in
the online log-sum-exp; with NEG the running max stays finite, those columns briefly count as
exp(0) = 1, and the first tile holding a real support column rescales them by exp(NEG - m) = 0 (and a
shard that never holds one merges with weight 0). NEG is far below any real logit yet small enough that
b * NEG in the gradient algebra cannot overflow, and exp(NEG - lse) is exactly 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

NEG = -1e20
"""The logit a column outside a token's support takes (see the module doc)."""


CHECK_BLOCK = 256
"""Tokens per block of `check_support` (bounds its memory with large nuclei: 256 x 45k ids ~ 90 MB)."""


def check_support(offsets: torch.Tensor, ids: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> None:
    """Raise ValueError unless (offsets, ids) is a well-formed support of the T tokens of `labels` whose
    ids lie in [0, vocab_size) and whose every token with a valid label holds that label (or is 'full').
    Every rank of a TP group checks the same tokens, so all of them raise or none does."""
    n = labels.shape[0]
    if offsets.dim() != 1 or offsets.shape[0] != n + 1:
        raise ValueError(f"support_offsets must be [T+1]={n + 1}, got {tuple(offsets.shape)}")
    if ids.dim() != 1 or offsets.dtype.is_floating_point or ids.dtype.is_floating_point:
        raise ValueError(f"support_ids must be a 1-D integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    lens = offsets[1:] - offsets[:-1]
    if int(offsets[0]) != 0 or int(offsets[-1]) != ids.shape[0] or bool((lens < 0).any()):
        raise ValueError(f"support_offsets must rise from 0 to len(support_ids)={ids.shape[0]}, got "
                         f"{int(offsets[0])}..{int(offsets[-1])}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"support_ids must lie in [0, vocab_size={vocab_size}), got {int(ids.min())}.."
                         f"{int(ids.max())}")
    for a in range(0, n, CHECK_BLOCK):
        b = min(a + CHECK_BLOCK, n)
        hits = (ids[offsets[a]:offsets[b]] == torch.repeat_interleave(labels[a:b], lens[a:b])).to(torch.int32)
        found = torch.zeros(b - a, dtype=torch.int32, device=ids.device).index_add_(
            0, torch.repeat_interleave(torch.arange(b - a, device=ids.device), lens[a:b]), hits)
        bad = (lens[a:b] > 0) & (labels[a:b] >= 0) & (labels[a:b] < vocab_size) & (found == 0)
        if bool(bad.any()):
            t = a + int(bad.nonzero()[0])
            raise ValueError(f"{int(bad.sum())}+ tokens are not in their own sampling support, e.g. token {t}: "
                             f"label {int(labels[t])} not among support_ids[{int(offsets[t])}:{int(offsets[t + 1])}]")


def support_mask(offsets: torch.Tensor, ids: torch.Tensor, n_tokens: int, vocab: int) -> torch.Tensor:
    """Dense [T, vocab] membership (full rows all True): for the full-logits reference twin only."""
    lens = (offsets[1:] - offsets[:-1]).long()
    mask = (lens == 0)[:, None].expand(n_tokens, vocab).clone()
    row = torch.repeat_interleave(torch.arange(n_tokens, device=ids.device), lens)
    mask[row, ids.long()] = True
    return mask


@dataclass
class ChunkColumns:
    """The columns of this rank's vocabulary shard that one chunk of n tokens needs, as positions
    0..n_cols-1 of a 'column space': row cols[j] of the shard's weight (or row j when cols is None), and
    which of them each token's support holds."""

    n_cols: int
    cols: Optional[torch.Tensor]
    """Sorted local row ids (int64), or None: every valid row 0..n_cols-1, contiguous."""
    label_col: torch.Tensor
    """[n] the position of each token's label in the column space (anything outside 0..n_cols-1: not here)."""
    membership: Optional[torch.Tensor] = None
    """[n, n_cols] bool: column j is in token i's support ('full' tokens: every column); None = all True."""

    def weight_rows(self, weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """The weight rows of column positions lo..hi-1 (a view, or a gathered copy)."""
        return weight[lo:hi] if self.cols is None else weight.index_select(0, self.cols[lo:hi])

    def add_weight_grad(self, dw: torch.Tensor, lo: int, hi: int, grad: torch.Tensor) -> None:
        """dw[rows of columns lo..hi-1] += grad (the gathered rows are distinct, so no two collide)."""
        if self.cols is None:
            dw[lo:hi].add_(grad)
        else:
            dw.index_add_(0, self.cols[lo:hi], grad.to(dw.dtype))

    def member(self, lo: int, hi: int) -> Optional[torch.Tensor]:
        """[n, hi-lo] bool membership of column positions lo..hi-1 (a view); None = all True."""
        return None if self.membership is None else self.membership[:, lo:hi]


def all_columns(n_valid: int, labels_local: torch.Tensor) -> ChunkColumns:
    """No supports: every valid row, no masking (the full-vocabulary path)."""
    return ChunkColumns(n_cols=n_valid, cols=None, label_col=labels_local)


def chunk_columns(offsets: torch.Tensor, ids: torch.Tensor, sl: slice, labels_local: torch.Tensor,
                  vocab_start: int, n_valid: int) -> ChunkColumns:
    """The column space of tokens `sl` (labels_local: their labels minus vocab_start) on this shard.
    `offsets`, `ids`: the whole call's CSR support, int64."""
    n = sl.stop - sl.start
    dev = labels_local.device
    lens = offsets[sl.start + 1:sl.stop + 1] - offsets[sl.start:sl.stop]
    full = lens == 0
    if bool(full.all()):
        return all_columns(n_valid, labels_local)
    local = ids[offsets[sl.start]:offsets[sl.stop]]  # a view of the caller's ids: never written to
    if vocab_start:
        local = local - vocab_start
    row = torch.repeat_interleave(torch.arange(n, device=dev), lens)
    here = (local >= 0) & (local < n_valid)  # under TP: this shard's ids only
    if not bool(here.all()):
        local, row = local[here], row[here]
    any_full = bool(full.any())
    cols, n_cols, col, label_col = None, n_valid, local, labels_local
    if not any_full and n_valid > 0:
        # The union of the chunk's supports on this shard, by a presence vector over the shard's rows
        # (no sort); a union over half the shard runs contiguous instead (module doc).
        present = torch.zeros(n_valid, dtype=torch.bool, device=dev)
        present[local] = True
        if 2 * int(present.sum()) <= n_valid:
            position = torch.cumsum(present, 0) - 1
            cols = present.nonzero().flatten()
            n_cols, col = int(cols.numel()), position[local]
            lab = labels_local.clamp(0, n_valid - 1)
            on_shard = (labels_local >= 0) & (labels_local < n_valid) & present[lab]
            label_col = torch.where(on_shard, position[lab], -1)
    membership = torch.zeros(n, n_cols, dtype=torch.bool, device=dev)
    if any_full:
        membership[full] = True
    membership.view(-1)[row.mul_(n_cols).add_(col)] = True  # row is ours: the flat index in place
    return ChunkColumns(n_cols=n_cols, cols=cols, label_col=label_col, membership=membership)
