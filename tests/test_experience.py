"""The experience's tensor views and the actor client's split, against per-row constructions."""

from __future__ import annotations

import random

import torch

from mgrpo.components.actor_client import balanced_split
from mgrpo.experience import Experience


def _experience(lengths: list[int], in_loss: list[bool]) -> Experience:
    n = len(lengths)
    return Experience(prompt_ids=[[1, 2]] * n, response_ids=[[3] * k for k in lengths],
                      rollout_logprobs=[[-1.0] * k for k in lengths], finish_reasons=["stop"] * n,
                      weight_versions=[0] * n, group_index=[i // 2 for i in range(n)], in_loss=in_loss)


def test_masks_and_padding_match_row_by_row():
    rng = random.Random(0)
    lengths = [rng.randint(0, 9) for _ in range(33)]
    in_loss = [rng.random() < 0.7 for _ in lengths]
    exp = _experience(lengths, in_loss)
    values = [[rng.uniform(-5, 5) for _ in range(k)] for k in lengths]
    width = max(lengths)
    mask, loss_mask, padded = (torch.zeros(len(lengths), width) for _ in range(3))
    for i, k in enumerate(lengths):
        mask[i, :k] = 1.0
        loss_mask[i, :k] = 1.0 if in_loss[i] else 0.0
        padded[i, :k] = torch.tensor(values[i])
    assert torch.equal(exp.response_mask(), mask)
    assert torch.equal(exp.response_mask(loss_only=True), loss_mask)
    assert torch.equal(exp.padded(values), padded) and exp.padded(values).dtype == torch.float32
    assert exp.unpadded(padded) == [torch.tensor(v, dtype=torch.float32).tolist() for v in values]
    empty = _experience([], [])
    assert empty.response_mask().shape == empty.padded([]).shape == (0, 1)


def test_balanced_split_is_a_partition_by_length():
    lengths = [7, 3, 9, 1, 4, 4, 8, 2]
    assert balanced_split(lengths, 1) == [list(range(8))]
    parts = balanced_split(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(8))
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= max(lengths)  # greedy longest-first: within one sample
