"""A batch's judgement: every sample scored by the rubric, with the policy for samples that get no reward.

A sample whose scorer failed (or that its producer marked failed before judging) has no score and leaves the loss
and its group's baseline; a group left too small is judged again or dropped (reward.failed.small_group); past
reward.failed.max_rate a training batch is refused (FailureRateExceeded: one line naming the keys to change; a
validation only warns). The experience applies the judgement (`Experience.apply_judgement`); nothing here knows it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from mgrpo.config.reward import FailedSamplesConfig
from mgrpo.rewards import failed
from mgrpo.rewards.scoring import OK, ScoreRequest, Scorer

log = logging.getLogger("mgrpo")


@dataclass
class Judgement:
    """Per sample, in the batch's order."""

    scores: list[Optional[float]]
    """The rubric's score; None: no reward (its outcome says why)."""
    outcomes: list[str]
    """'ok', or why it has no reward ('failed', 'timeout', or a producer's own kind)."""
    failed_by: list[str]
    """Who failed it ('rule:<data_source>', 'model:<name>', a producer's name); '' when ok."""
    masked: list[bool]
    """Left out of the loss and its group's baseline: no reward, or too many of its group have none."""
    measured: dict[str, float] = field(default_factory=dict)
    """The step's reward metrics: failures by kind and scorer, restarts, each scorer's mean, re-judged samples."""


def judge_batch(scorer: Scorer, requests: Sequence[ScoreRequest], group_index: Sequence[Hashable],
          outcomes: Sequence[str], failed_by: Sequence[str], fc: FailedSamplesConfig, *,
          training: bool = True) -> Judgement:
    """Score `requests` (one per sample) with `scorer`, except the samples `outcomes` marks failed already (a
    producer's failure: final). A scorer's failure in a group left short is judged again (rejudge_attempts); then
    short groups are dropped, and the failure rate checked (`training`: refused past max_rate; else a warning)."""
    n = len(requests)
    j = Judgement([None] * n, list(outcomes) or [OK] * n, list(failed_by) or [""] * n, [])
    todo = [i for i in range(n) if j.outcomes[i] == OK]
    out = _score(scorer, requests, todo, j)
    rejudged = 0
    for _ in range(fc.rejudge_attempts if fc.small_group == "rejudge" else 0):
        short = set(failed.short_groups(j.outcomes, group_index, fc.min_group_size))
        again = [i for i in todo if group_index[i] in short and j.outcomes[i] != OK]
        if not again:
            break
        rejudged += len(again)
        more = _score(scorer, requests, again, j)  # counts add up; a second round's means are of its few samples
        out = {**out, **{k: out.get(k, 0.0) + more[k] for k in ("reward/worker_restarts", "reward/model_restarts")
                         if k in more}, "errors": out["errors"] + more["errors"]}
    dropped = failed.short_groups(j.outcomes, group_index, fc.min_group_size)
    j.masked = failed.masked(j.outcomes, group_index, dropped)
    failed.check_rate(j.outcomes, j.failed_by, warn_rate=fc.warn_rate, max_rate=fc.max_rate, enforce=training,
                      log=log, errors=out.pop("errors", None))
    j.measured = {**out, **failed.failure_counts(j.outcomes, j.failed_by, j.masked, len(dropped)),
                  "reward/rejudged": float(rejudged)}
    return j


def _score(scorer: Scorer, requests: Sequence[ScoreRequest], idx: list[int], j: Judgement) -> dict:
    """Score samples `idx`; set their scores and outcomes in `j`; what the scorer measured."""
    got = scorer.score([requests[i] for i in idx])
    for i, score, status, by in zip(idx, got.scores, got.status, got.failed_by):
        j.scores[i] = None if score is None else float(score)
        j.outcomes[i], j.failed_by[i] = status, by
    out = {"reward/worker_restarts": float(got.worker_restarts), "errors": list(got.errors), **got.measured}
    for name, values in got.components.items():  # each scorer's own mean, e.g. the rule next to a model
        scored = [v for v in values if v is not None]
        if scored:
            out[f"reward/{name}/mean"] = sum(scored) / len(scored)
    return out
