"""Dynamic sampling, overlong filtering and overlong reward shaping (DAPO)."""

from __future__ import annotations

import numpy as np
import pytest

from mgrpo.algorithms.filtering import (GroupAccumulator, apply_overlong_buffer, groups_with_signal, overlong_filter,
                                        overlong_penalty)
from mgrpo.config import OverlongBufferConfig


def test_groups_with_signal():
    # group 'a' all 1, 'b' mixed, 'c' all 0, 'd' mixed -> keep b, d (first-seen order)
    kept, dropped = groups_with_signal([1, 1, 0, 1, 0, 0, 1, 0], ["a", "a", "b", "b", "c", "c", "d", "d"])
    assert kept == ["b", "d"] and dropped == 2


def test_group_accumulator_fills_batch_over_rounds():
    acc = GroupAccumulator(train_batch_size=3, max_num_gen_batches=5)
    # round 0: groups 0 (mixed) and 1 (all equal) -> 1 kept
    assert acc.add(["r0a", "r0b", "r0c", "r0d"], [1, 0, 1, 1], [0, 0, 1, 1]) == 1
    assert not acc.full and not acc.exhausted
    # round 1 reuses group ids 0, 1: they are different prompts and must not merge with round 0
    assert acc.add(["r1a", "r1b", "r1c", "r1d", "r1e", "r1f"], [0, 1, 1, 0, 0.5, 0.2], [0, 0, 1, 1, 2, 2]) == 3
    assert acc.full
    groups = acc.take()
    assert groups == [["r0a", "r0b"], ["r1a", "r1b"], ["r1c", "r1d"]]
    m = acc.metrics()
    assert m["dynamic_sampling/num_gen_batches"] == 2
    assert m["dynamic_sampling/kept_groups"] == 4
    assert m["dynamic_sampling/filtered_groups"] == 1
    # the policy's reward is over all 10 responses generated, the filtered ones included: 5.7 / 10
    assert abs(m["dynamic_sampling/score_all_mean"] - 0.57) < 1e-12
    assert m["dynamic_sampling/surplus_groups"] == 1   # the 4th kept group did not fit
    assert m["dynamic_sampling/batch_groups"] == 3


def test_group_accumulator_exhausts():
    acc = GroupAccumulator(train_batch_size=2, max_num_gen_batches=2)
    acc.add([1, 2], [1.0, 1.0], [0, 0])
    acc.add([3, 4], [0.0, 1.0], [0, 0])
    assert acc.exhausted and not acc.full
    assert acc.take() == [[3, 4]]
    unlimited = GroupAccumulator(train_batch_size=2, max_num_gen_batches=0)
    for _ in range(10):
        unlimited.add([1, 2], [1.0, 1.0], [0, 0])
    assert not unlimited.exhausted


def test_overlong_filter():
    mask = np.array([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    new, n = overlong_filter(mask, np.array([True, False, True]))
    assert new.tolist() == [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert n == 1  # the empty third response was not in the loss anyway


def test_overlong_penalty_by_hand():
    # max_response_length 10, buffer 4 -> free up to 6 tokens, then -1/4 per token (factor 1): 8 -> -0.5
    cfg = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    pen = overlong_penalty(np.array([3, 6, 7, 8, 10]), 10, cfg)
    assert pen.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    shaped, n = apply_overlong_buffer(np.array([1.0, 1.0, 0.0, 1.0, 1.0]), np.array([3, 6, 7, 8, 10]), 10,
                                      OverlongBufferConfig(enable=True, len=4, penalty_factor=2.0))
    assert shaped.tolist() == pytest.approx([1.0, 1.0, -0.5, 0.0, -1.0]) and n == 3 and shaped.dtype == np.float32
    same, n = apply_overlong_buffer(np.array([1.0]), np.array([10]), 10, OverlongBufferConfig(enable=False))
    assert same.tolist() == [1.0] and n == 0
