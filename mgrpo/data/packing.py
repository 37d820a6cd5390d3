"""Micro-batches under a token budget (actor.max_tokens_per_gpu).

Two costs, one per micro-batch format (mgrpo.training.batch):
  - padded [b, s] rows cost count x longest tokens: `pack_micro_batches` bounds that padded size.
    Sorting by length first puts similar lengths together, which keeps the padding small.
  - packed (THD) rows cost the sum of the lengths: `pack_by_tokens` fills micro-batches first-fit,
    longest first, so there is no padding at all (beyond any per-sequence rounding the caller
    already added to the lengths).
Ties keep their original order so the result is deterministic. The gradient does not depend on the
cut (the loss weights are global, see mgrpo.algorithms.aggregation), so the packers are free to
reorder.

A sample longer than the budget cannot be split here; it gets a micro-batch of its own and is
reported by `over_budget` so the trainer can count it. (Context parallelism splits it over ranks:
the trainer budgets cp x max_tokens_per_gpu per micro-batch.)
"""

from __future__ import annotations

from typing import Sequence


def pack_micro_batches(lengths: Sequence[int], max_tokens: int, *, min_micro_batches: int = 1) -> list[list[int]]:
    """Sample indices grouped into micro-batches with len(group) * max(lengths in group) <= max_tokens.

    Longest samples first; each micro-batch is filled greedily. `min_micro_batches` splits the
    largest groups further until there are at least that many (useful to give every data-parallel
    rank the same number of micro-batches); it cannot exceed the number of samples.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be positive")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    groups: list[list[int]] = []
    for i in order:
        # Lengths are non-increasing, so the group's first sample is its longest.
        if groups and (len(groups[-1]) + 1) * max(lengths[groups[-1][0]], 1) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    if min_micro_batches > len(lengths):
        raise ValueError(f"min_micro_batches={min_micro_batches} exceeds the {len(lengths)} samples")
    while len(groups) < min_micro_batches:
        # Split the group with the most padded tokens; halves stay under budget.
        splittable = [k for k in range(len(groups)) if len(groups[k]) > 1]
        j = max(splittable, key=lambda k: (len(groups[k]) * lengths[groups[k][0]], len(groups[k])))
        g = groups[j]
        groups[j:j + 1] = [g[: len(g) // 2], g[len(g) // 2:]]
    return groups


def pack_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sample indices grouped into micro-batches with sum(lengths in group) <= max_tokens.

    First-fit decreasing: longest first, each into the first micro-batch with room, else a new one.
    Within a micro-batch the samples keep ascending index order."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens={max_tokens} must be positive")
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((k for k, r in enumerate(room) if lengths[i] <= r), None)
        if k is None:
            groups.append([i])
            room.append(max_tokens - lengths[i])
        else:
            groups[k].append(i)
            room[k] -= lengths[i]
    return [sorted(g) for g in groups]


def over_budget(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """Indices of samples that alone exceed the budget (each packed as a micro-batch of one)."""
    return [i for i, n in enumerate(lengths) if n > max_tokens]


def padded_tokens(lengths: Sequence[int], groups: list[list[int]]) -> int:
    """Tokens the micro-batches occupy once padded (for efficiency metrics)."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups if g)
