"""Rewards of the built-in synthetic tasks (mgrpo.data.synthetic).

mgrpo/sum: 1.0 only for exactly the digits of the sum followed by EOS, i.e. the decoded response
(special tokens skipped) equals the ground truth and the engine stopped on EOS
(extra_info['finish_reason'] == 'stop'); 0.0 otherwise. A response cut at max_response_length
("10" then more digits, or no EOS) earns nothing, which is what teaches the model to stop.
"""

from __future__ import annotations

import re
from typing import Optional


def sum_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    if not extra_info or "finish_reason" not in extra_info:
        raise ValueError("mgrpo/sum needs extra_info['finish_reason'] ('stop' when the response ended with EOS)")
    text = solution_str
    if text.endswith("<eos>"):  # decoded without skip_special_tokens
        text = text[: -len("<eos>")]
    return 1.0 if extra_info["finish_reason"] == "stop" and text == str(ground_truth) else 0.0


def peek_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    """mgrpo/peek (multi-turn; extra_info['turns'] from the agent): 1.0 when the answer, the first digit the
    last assistant turn writes (its think block left out), is the hidden digit; 0.0 otherwise, with no
    credit for format. Only the peek tool's reply says the digit: without it the answer is a guess (chance 0.1
    when a digit is written at all)."""
    if not extra_info or "turns" not in extra_info:
        raise ValueError("mgrpo/peek is a multi-turn task: it needs extra_info['turns'] (rollout.multi_turn.enable)")
    said = [t["text"] for t in extra_info["turns"]["turns"] if t["role"] == "assistant"]
    last = re.sub(r"<think>.*?</think>", "", said[-1] if said else solution_str, flags=re.S)
    digit = re.search(r"[0-9]", last)
    return 1.0 if digit is not None and digit.group(0) == str(ground_truth) else 0.0
