"""Micro-batches under a token budget (actor.max_tokens_per_gpu).

On CPU and in the padded Megatron path a micro-batch costs count x longest tokens, so the packer
bounds that padded size, not the sum of lengths. Sorting by length first puts similar lengths
together, which keeps the padding small; ties keep their original order so the result is
deterministic. The gradient does not depend on the cut (the loss weights are global, see
mgrpo.algorithms.aggregation), so the packer is free to reorder.

A sample longer than the budget cannot be split here; it gets a micro-batch of its own and is
reported by `over_budget` so the trainer can count it.
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


def over_budget(lengths: Sequence[int], max_tokens: int) -> list[int]:
    """Indices of samples that alone exceed the budget (each packed as a micro-batch of one)."""
    return [i for i, n in enumerate(lengths) if n > max_tokens]


def padded_tokens(lengths: Sequence[int], groups: list[list[int]]) -> int:
    """Tokens the micro-batches occupy once padded (for efficiency metrics)."""
    return sum(len(g) * max(lengths[i] for i in g) for g in groups if g)
