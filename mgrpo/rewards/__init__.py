"""Judgers: reward functions keyed by data_source, run in isolated worker processes with timeouts.

Imports only mgrpo.config and libraries (math-verify lazily); no torch, so worker processes start fast.
"""

from mgrpo.rewards.judger import Judger, ScoreRequest, ScoreResult
from mgrpo.rewards.metrics import eval_metrics
from mgrpo.rewards.registry import (
    BUILTIN_REWARDS,
    check_data_sources,
    get_reward_fn,
    load_function,
    reward_functions,
    to_score,
)

__all__ = [
    "BUILTIN_REWARDS", "Judger", "ScoreRequest", "ScoreResult", "check_data_sources", "eval_metrics",
    "get_reward_fn", "load_function", "reward_functions", "to_score",
]
