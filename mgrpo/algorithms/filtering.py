"""DAPO's batch shaping: dynamic sampling (filter_groups), overlong filtering and overlong reward shaping.

Each function returns counts next to its result, so the trainer can log what was dropped or changed
(nothing is lost silently). numpy, not torch: all of it runs on the driver, which never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

import numpy as np

from mgrpo.config.schema import OverlongBufferConfig

# --- dynamic sampling ------------------------------------------------------------------------------

def groups_with_signal(scores: Sequence[Optional[float]],
                       group_ids: Sequence[Hashable]) -> tuple[list[Hashable], int]:
    """(ids of groups whose scores are not all equal, in first-seen order; number of groups dropped).

    A group whose responses all got the same score has zero advantage under every group-relative
    estimator: it costs a forward/backward and contributes no gradient (DAPO's dynamic sampling).
    A None score (a sample without a reward, out of the baseline) carries no signal.
    """
    seen: dict[Hashable, set] = {}
    for s, g in zip(scores, group_ids, strict=True):
        vals = seen.setdefault(g, set())
        if s is not None:
            vals.add(float(s))
    kept = [g for g, vals in seen.items() if len(vals) > 1]
    return kept, len(seen) - len(kept)


@dataclass
class GroupAccumulator:
    """Collects kept prompt groups over several generation rounds until `train_batch_size` prompts.

    Usage per training step:
        acc = GroupAccumulator(cfg.data.train_batch_size, cfg.algorithm.filter_groups.max_num_gen_batches)
        while not acc.full and not acc.exhausted:
            samples, scores, groups = generate(next_batch())
            acc.add(samples, scores, groups)
        batch = acc.take()      # samples of the first train_batch_size kept groups, in order
        metrics.update(acc.metrics())
    `samples` are opaque (whatever the trainer keeps per response). Group ids only need to be unique
    within one round: rounds are kept apart internally.
    """

    train_batch_size: int
    max_num_gen_batches: int = 0
    """Rounds allowed before `exhausted` (0 = unlimited)."""
    num_gen_batches: int = 0
    num_filtered_groups: int = 0
    num_kept_groups: int = 0
    num_surplus_groups: int = 0
    """Kept groups beyond train_batch_size, dropped by `take` (the last round overshot)."""
    score_sum: float = 0.0
    num_samples: int = 0
    """Every generated response's score, kept or not: the policy's reward (the batch's is biased upward)."""
    _groups: dict[tuple[int, Hashable], list[Any]] = field(default_factory=dict, init=False, repr=False)

    def add(self, samples: Sequence[Any], scores: Sequence[Optional[float]], group_ids: Sequence[Hashable]) -> int:
        """Add one round's responses (a None score: no reward, see groups_with_signal); returns how many groups
        of it were kept."""
        if not len(samples) == len(scores) == len(group_ids):
            raise ValueError(f"samples, scores and group_ids differ in length: "
                             f"{len(samples)}, {len(scores)}, {len(group_ids)}")
        kept, dropped = groups_with_signal(scores, group_ids)
        keep = set(kept)
        r = self.num_gen_batches
        for s, g in zip(samples, group_ids):
            if g in keep:
                self._groups.setdefault((r, g), []).append(s)
        self.num_gen_batches += 1
        self.score_sum += float(sum(s for s in scores if s is not None))
        self.num_samples += sum(s is not None for s in scores)
        self.num_filtered_groups += dropped
        self.num_kept_groups += len(kept)
        return len(kept)

    @property
    def full(self) -> bool:
        return len(self._groups) >= self.train_batch_size

    @property
    def exhausted(self) -> bool:
        return 0 < self.max_num_gen_batches <= self.num_gen_batches and not self.full

    def take(self) -> list[list[Any]]:
        """The first train_batch_size kept groups (fewer if exhausted), each a list of its samples.
        Extra kept groups beyond the batch are dropped and counted."""
        groups = list(self._groups.values())
        self.num_surplus_groups = max(len(groups) - self.train_batch_size, 0)
        return groups[: self.train_batch_size]

    def metrics(self) -> dict[str, float]:
        return {
            "dynamic_sampling/num_gen_batches": float(self.num_gen_batches),
            "dynamic_sampling/kept_groups": float(self.num_kept_groups),
            "dynamic_sampling/filtered_groups": float(self.num_filtered_groups),
            "dynamic_sampling/surplus_groups": float(self.num_surplus_groups),
            "dynamic_sampling/batch_groups": float(min(len(self._groups), self.train_batch_size)),
            "dynamic_sampling/score_all_mean": self.score_sum / max(self.num_samples, 1),
        }


# --- overlong responses ----------------------------------------------------------------------------

def overlong_filter(response_mask: np.ndarray, truncated: np.ndarray) -> tuple[np.ndarray, int]:
    """Mask truncated responses (hit max_response_length without EOS) out of the loss entirely
    (DAPO's overlong filtering): their reward says nothing about the answer, which was cut off.
    Returns (new mask, number of responses masked). The trainer's global token/sequence counts
    must be taken after this."""
    truncated, response_mask = np.asarray(truncated, dtype=bool), np.asarray(response_mask)
    mask = response_mask * (~truncated)[:, None].astype(response_mask.dtype)
    return mask, int((truncated & response_mask.astype(bool).any(-1)).sum())


def overlong_penalty(response_lengths: np.ndarray, max_response_length: int,
                     cfg: OverlongBufferConfig) -> np.ndarray:
    """DAPO's soft overlong punishment [N]: 0 up to max_response_length - len tokens, then falling
    linearly to -penalty_factor at max_response_length:
        penalty = min(0, -(length - (max_len - buffer_len)) / buffer_len * penalty_factor)
    """
    expected = max_response_length - cfg.len
    exceed = np.asarray(response_lengths, dtype=np.float32) - np.float32(expected)
    return np.minimum(-exceed / np.float32(cfg.len) * np.float32(cfg.penalty_factor), np.float32(0.0))


def apply_overlong_buffer(scores: np.ndarray, response_lengths: np.ndarray, max_response_length: int,
                          cfg: OverlongBufferConfig) -> tuple[np.ndarray, int]:
    """(scores + overlong penalty, number of responses penalised); scores unchanged when disabled."""
    if not cfg.enable:
        return scores, 0
    pen = overlong_penalty(response_lengths, max_response_length, cfg)
    return np.asarray(scores, dtype=np.float32) + pen, int((pen < 0).sum())
