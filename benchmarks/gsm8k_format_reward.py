"""The reward both sides of the qwen3vocab comparison use: mgrpo's GSM8K judge plus veRL's format credit.

veRL's GSM8K scorer gives `score` (1.0) for the right answer, `format_score` when an answer was extracted
but is wrong, and 0 when none was found. A randomly initialised model never writes the right answer, but
its responses often hold a number (Qwen3's vocabulary has many digit tokens), so with a format credit both
sides earn rewards that differ between samples. mgrpo's reward workers and TRL's process import this
module by name (`gsm8k_format_reward:score`, with benchmarks/ on the path).
"""

from __future__ import annotations

from typing import Optional

from mgrpo.rewards.gsm8k import compute_score, extract_answer

FORMAT_SCORE = 0.1


def score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    if compute_score(data_source, solution_str, ground_truth, extra_info) == 1.0:
        return 1.0
    return FORMAT_SCORE if extract_answer(solution_str) is not None else 0.0
