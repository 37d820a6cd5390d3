"""Judgers: reward functions keyed by data_source, run in isolated worker processes with timeouts.

Imports only mgrpo.config and libraries (math-verify lazily); no torch, so worker processes start fast.

  registry.py     reward functions keyed by data_source, veRL's signature
  judger.py       the Judger: scores in isolated worker processes, with timeouts
  worker.py       a reward worker process (`python -m mgrpo.rewards.worker`)
  gsm8k.py        veRL's GSM8K judge
  math_reward.py  competition math with math-verify
  synthetic.py    rewards of the built-in synthetic tasks
  judge.py        generative judges: the prompt a judge reads, its answer parsed to a score
  service.py      an HTTP reward service (slime's --rm-url)
  metrics.py      validation metrics per data source (mean@n, pass@n)
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
