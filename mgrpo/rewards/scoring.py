"""The one reward concept: every scorer (rules by data_source, a user's function, a reward model, a generative
judge, an HTTP reward service, and the weighted rubric over them) takes `ScoreRequest`s and answers one
`ScoreResult`: per request a score or None, its outcome, and who failed it. A failed call is never a 0.0 score:
its sample leaves the loss and its group's baseline (mgrpo/rewards/failed.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

from mgrpo.rewards.failed import FAILED, OK, TIMEOUT

MAX_ERRORS_KEPT = 5


@dataclass
class ScoreRequest:
    data_source: str
    response: str
    """The decoded response (the reward function's `solution_str`)."""
    ground_truth: str
    extra_info: Optional[dict] = None
    prompt: Any = None
    """The record's prompt as written (a string or chat messages), for scorers that read it (reward models)."""


@dataclass
class ScoreResult:
    scores: list[Optional[float]]
    """Per request: its score, or None when the call failed (see `status`)."""
    failed: int = 0
    """Calls that raised or answered something other than a finite number (no score)."""
    timeout: int = 0
    """Calls that exceeded their timeout (no score)."""
    worker_restarts: int = 0
    """Reward workers found dead (exited or killed, not timed out) and replaced."""
    status: list[str] = field(default_factory=list)
    """Per request: 'ok' | 'failed' | 'timeout'."""
    failed_by: list[str] = field(default_factory=list)
    """Per request: which scorer failed it ('rule:<data_source>', 'model:<name>', 'judge:<name>',
    'service:<name>'), '' when ok."""
    errors: list[str] = field(default_factory=list)
    """The first few failure messages, for logs."""
    components: dict[str, list[Optional[float]]] = field(default_factory=dict)
    """Scorer name -> per request its own score (None: not asked, or failed), when several are combined."""
    measured: dict[str, float] = field(default_factory=dict)
    """What the scorers measured beyond the counts above (model restarts, seconds, samples/s, a judge's counts)."""

    @classmethod
    def empty(cls, n: int) -> "ScoreResult":
        """n requests, all ok and none scored yet."""
        return cls(scores=[None] * n, status=[OK] * n, failed_by=[""] * n)

    def fail(self, i: int, status: str, by: str, error: str) -> None:
        """Request i has no score: `status` 'failed' or 'timeout', `by` the scorer's name, `error` why."""
        self.scores[i], self.status[i], self.failed_by[i] = None, status, by
        self.failed += status != TIMEOUT
        self.timeout += status == TIMEOUT
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(f"{by}: {error}")

    def metrics(self) -> dict[str, float]:
        return {"reward/failed": float(self.failed), "reward/timeouts": float(self.timeout),
                "reward/worker_restarts": float(self.worker_restarts)}


class Scorer(Protocol):
    """What every scorer is: `score` never raises for a failure of what it calls (those requests get no score and
    their outcome), and `close` lets go of what it holds (worker processes, servers, sessions)."""

    def score(self, requests: Sequence[ScoreRequest]) -> ScoreResult: ...

    def close(self) -> None: ...


__all__ = ["FAILED", "OK", "TIMEOUT", "ScoreRequest", "ScoreResult", "Scorer"]
