"""Rewards, one concept: scorers (rules by data_source, user functions, reward models, generative judges, HTTP reward
services) that all take `ScoreRequest`s and answer a `ScoreResult`; the `Rubric` composing them by weight; the
`judge` that turns a batch's scores into a `Judgement` (failed samples masked, never 0.0).

Imports only mgrpo.config and libraries (math-verify, transformers, openai lazily); no torch, so worker processes
start fast. Servers are started and reached through an `EngineKit` given from above (cluster/aux_engines.py).

  scoring.py      the one protocol: ScoreRequest in, ScoreResult out
  rubric.py       every scorer of a run composed per data_source by weight (reward.compose)
  judging.py      a batch's judgement: re-judging, masks of failed samples, the failure rate
  failed.py       samples without a reward: which groups keep a baseline, what failures count as
  rules.py        reward functions by data_source in isolated worker processes, with timeouts
  worker.py       a reward worker process (`python -m mgrpo.rewards.worker`)
  registry.py     reward functions keyed by data_source, veRL's signature
  gsm8k.py        veRL's GSM8K judge
  math_reward.py  competition math with math-verify
  synthetic.py    rewards of the built-in synthetic tasks
  models.py       reward models (sequence classifiers) on auxiliary engines
  generative.py   generative judges on auxiliary engines
  judge.py        a judge's prompt, and its answer parsed to a score
  hosting.py      a scorer's servers: start, reach, health-check, restart (composition, not inheritance)
  service.py      an HTTP reward service (slime's --rm-url)
  metrics.py      validation metrics per data source (mean@n, pass@n)
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
