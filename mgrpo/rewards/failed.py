"""Samples without a reward: which prompt groups keep a baseline, and what the failures count as.

A sample whose reward could not be produced (a judge that raised, timed out or answered garbage; a model,
judge or service that was down; a producer's generation or environment failure) has no score. Scoring it 0
would teach the policy that the answer was wrong, and put a fake 0 into its group's mean and std, moving
every other member's advantage. So it carries a failed outcome instead, and:
  - it is left out of the loss and out of its group's baseline: advantages are over the remaining members;
  - a group left with fewer than reward.failed.min_group_size scored members has no baseline worth the
    name: it is dropped from the loss (or its failed members are judged again first, small_group=rejudge);
  - every failure is counted per step and per source (`reward/failed`, `reward/timeouts`,
    `reward/masked_samples`, `reward/failed/<source>`, ...), with a warning line past
    reward.failed.warn_rate and a refusal to go on past reward.failed.max_rate.

Plain Python over per-sample lists (the experience's order); no torch, no processes.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Hashable, Optional, Sequence

from mgrpo.config import InputError

OK = "ok"
"""The outcome of a sample that was scored."""
FAILED = "failed"
"""A failed outcome: the scorer raised, answered garbage, or was down."""
TIMEOUT = "timeout"
"""A failed outcome: the judge (model, service) did not answer in time. Every other non-OK outcome is a failure
of its own kind ('failed': raised or answered garbage; producers may name theirs, e.g. 'env_failed')."""
ABORTED = "aborted"
"""Not a failure: cut on purpose as the step's long tail (rollout.over_sample_rate, veRL's). Left out of the
loss and its group's baseline like a failure, and of reward/failed and the failure rate: the rollout counts
it (`rollout/aborted`)."""
ROLLOUT_CUT = "over_sample"
"""Who marks an aborted sample (its failed_by)."""


class FailureRateExceeded(InputError, RuntimeError):
    """A training step's share of failed samples passed reward.failed.max_rate: the judges are broken (usually
    configured wrong), not flaky. One line naming the keys to change; the launchers print it and exit 2."""


def short_groups(outcomes: Sequence[str], group_index: Sequence[Hashable], min_group_size: int) -> list[Hashable]:
    """Groups (first-seen order) that lost members to failures and have fewer than `min_group_size` scored
    members left. A group that was small to begin with (rollout.n=1) is short only when it has none left."""
    size: Counter = Counter(group_index)
    scored: Counter = Counter(g for g, o in zip(group_index, outcomes) if o == OK)
    seen = dict.fromkeys(group_index)
    return [g for g in seen if scored[g] < size[g] and scored[g] < min(min_group_size, size[g])]


def masked(outcomes: Sequence[str], group_index: Sequence[Hashable], dropped: Sequence[Hashable]) -> list[bool]:
    """Per sample: left out of the loss and the baseline (its own reward failed, or its group was dropped)."""
    gone = set(dropped)
    return [o != OK or g in gone for o, g in zip(outcomes, group_index)]


def failure_counts(outcomes: Sequence[str], sources: Sequence[str], masked_flags: Sequence[bool],
                   dropped_groups: int) -> dict[str, float]:
    """A step's failure metrics: totals and one pair per source (`sources[i]` names who failed sample i,
    e.g. 'rule:openai/gsm8k', 'model:rm', 'env:sandbox')."""
    out = {"reward/failed": 0.0, "reward/timeouts": 0.0, "reward/masked_samples": float(sum(masked_flags)),
           "reward/dropped_groups": float(dropped_groups)}
    for o, src in zip(outcomes, sources):
        if o in (OK, ABORTED):
            continue
        kind = "reward/timeouts" if o == TIMEOUT else "reward/failed"
        out[kind] += 1
        out[f"{kind}/{src or 'unknown'}"] = out.get(f"{kind}/{src or 'unknown'}", 0.0) + 1
    return out


def failure_rate(outcomes: Sequence[str]) -> float:
    """The share of failed samples among those not cut on purpose (ABORTED)."""
    kept = [o for o in outcomes if o != ABORTED]
    return sum(o != OK for o in kept) / max(len(kept), 1)


def fix_keys(failed_by: Counter, errors: Optional[Sequence[str]]) -> list[str]:
    """The config keys that decide how the failing scorers score, the most failing first: a scorer's errors may
    name the key themselves ('... (reward.models.judge.judge.top_logprobs=5) ...'), else its section."""
    named = [k for e in (errors or []) for k in _KEY.findall(str(e))]
    section = {"rule": "reward.custom_functions / reward.timeout_s", "model": "reward.models.{}",
               "judge": "reward.models.{}.judge", "service": "reward.services.{}",
               "multi_turn": "rollout.multi_turn.tool_timeout_s / trajectory_timeout_s"}
    for src, _ in failed_by.most_common():
        kind, _, name = str(src).partition(":")
        if kind in section:
            named.append(section[kind].format(name))
    return list(dict.fromkeys(named)) or ["the failing scorer's keys"]


_KEY = re.compile(r"\b(reward\.(?:models|services)\.[\w.-]+?\.[a-z_]+)=")


def check_rate(outcomes: Sequence[str], sources: Sequence[str], *, warn_rate: float, max_rate: float,
               enforce: bool, log, errors: Optional[Sequence[str]] = None) -> None:
    """A warning line when the share of failed samples passes `warn_rate`; FailureRateExceeded past `max_rate`
    when `enforce` (training batches; a validation only warns)."""
    rate = failure_rate(outcomes)
    if rate <= warn_rate and not (enforce and rate > max_rate):
        return
    by = Counter(s for o, s in zip(outcomes, sources) if o not in (OK, ABORTED))
    total = sum(o != ABORTED for o in outcomes)
    said = ", ".join(f"{src} {k}" for src, k in by.most_common())
    example = f"; e.g. {' '.join(str(errors[0]).split())[:400]}" if errors else ""  # one line
    if enforce and rate > max_rate:
        raise FailureRateExceeded(
            f"{sum(by.values())} of {total} samples ({rate:.0%}) have no reward ({said}), past "
            f"reward.failed.max_rate={max_rate}: the judges (or the rollouts: 'multi_turn') are failing, not the "
            f"policy{example}. Change {', '.join(fix_keys(by, errors))} (or raise reward.failed.max_rate) and resume")
    log.warning("reward: %d of %d samples (%.0f%%) have no reward (%s), past reward.failed.warn_rate=%s; they are "
                "left out of the loss and their groups' baselines%s", sum(by.values()), total, 100 * rate,
                said, warn_rate, example)
