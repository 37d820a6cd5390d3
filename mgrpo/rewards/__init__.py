"""Rewards, one concept: scorers (rules by data_source, user functions, reward models, generative judges, HTTP reward
services) that all take `ScoreRequest`s and answer a `ScoreResult`; the `Rubric` composing them by weight; the
`judge` that turns a batch's scores into a `Judgement` (failed samples masked, never 0.0).

Imports only mgrpo.config and libraries (math-verify, transformers, openai lazily); no torch, so worker processes
start fast. Servers are started and reached through an `EngineKit` given from above (cluster/aux_engines.py).
"""

from mgrpo.rewards.failed import FailureRateExceeded
from mgrpo.rewards.judging import Judgement, judge_batch
from mgrpo.rewards.metrics import eval_metrics
from mgrpo.rewards.registry import (
    BUILTIN_REWARDS,
    check_data_sources,
    get_reward_fn,
    load_function,
    reward_functions,
    to_score,
)
from mgrpo.rewards.rubric import Rubric, build_rubric
from mgrpo.rewards.rules import Rules
from mgrpo.rewards.scoring import ScoreRequest, ScoreResult, Scorer

__all__ = [
    "BUILTIN_REWARDS", "FailureRateExceeded", "Judgement", "Rubric", "Rules", "ScoreRequest", "ScoreResult",
    "Scorer", "build_rubric", "check_data_sources", "eval_metrics", "get_reward_fn", "judge_batch", "load_function",
    "reward_functions", "to_score",
]
