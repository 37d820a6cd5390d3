"""Competition math (MATH, DAPO-Math, AIME...) judged with Hugging Face's math-verify.

As veRL's math_verify judge: the ground truth is wrapped in \\boxed{} and parsed as LaTeX; the
response is searched for a final answer as a LaTeX (\\boxed{...}, $...$) or plain expression; the two
are compared symbolically (fractions, radicals, intervals, equivalent forms).

math-verify guards its own parsing with signal.alarm, which only works in a process's main thread;
off the main thread its timeouts are switched off here and the Rules's process timeout applies.
"""

from __future__ import annotations

import threading
from typing import Optional

SOURCES = ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
           "math_dapo", "math_dapo_reasoning", "BytedTsinghua-SIA/DAPO-Math-17k", "aime2024", "aime2025")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = parse("\\boxed{" + str(ground_truth) + "}", extraction_config=[LatexExtractionConfig()],
                 parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
    pred = parse(solution_str, extraction_config=[ExprExtractionConfig(), LatexExtractionConfig()],
                 parsing_timeout=timeout)
    return 1.0 if pred and verify(gold, pred, timeout_seconds=timeout) else 0.0


def warm() -> None:
    """Import sympy and build math-verify's parsers (~0.35 s idle, seconds under load) before a reward worker
    says it is ready, so that reward.timeout_s times the judgement, not the first call's imports."""
    compute_score("math", "\\boxed{1}", "1")
