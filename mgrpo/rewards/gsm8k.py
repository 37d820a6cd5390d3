"""GSM8K: veRL's judge (verl/utils/reward_score/gsm8k.py), the same rules and scores.

strict (veRL's default): the answer is the number after the last '#### ' in the response's last 300
characters, commas and '$' removed; a response without '#### <number>' has no answer. The answer format is
part of the score, as in veRL: "I think it's 72" scores 0.
flexible: the answer is the last run of digits, '.' and ',' that is not a lone '.' (commas kept).

The answer is compared with the ground truth as a string (GSM8K's ground truths are integers without
separators, as `mgrpo-prepare gsm8k` writes them). Scores: `score` (1.0) when equal, `format_score` when an
answer was found but differs (veRL's format credit; its default 0.0, configured as reward.gsm8k.format_score),
0 when there is no answer. reward.gsm8k.method picks the mode.
"""

from __future__ import annotations

import re
from typing import Optional

CLIP_CHARS = 300
"""veRL matches on the last 300 characters only (a long response's answer is at its end)."""
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")
METHODS = ("strict", "flexible")


def extract_solution(solution_str: str, method: str = "strict") -> Optional[str]:
    """The answer string the judge compares with the ground truth, or None (see the module docstring)."""
    if method not in METHODS:
        raise ValueError(f"GSM8K method {method!r}: expected one of {METHODS}")
    text = solution_str[-CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    answer = None
    for answer in reversed(_FLEXIBLE.findall(text)):
        if answer not in ("", "."):
            break
    return answer  # as veRL: when every match is '.', the last one tried


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None, *,
                  method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> float:
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth) else float(format_score)
