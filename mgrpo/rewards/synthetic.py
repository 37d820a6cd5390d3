"""Rewards of the built-in synthetic tasks (mgrpo.data.synthetic).

mgrpo/sum: 1.0 only for exactly the digits of the sum followed by EOS, i.e. the decoded response
(special tokens skipped) equals the ground truth and the engine stopped on EOS
(extra_info['finish_reason'] == 'stop'); 0.0 otherwise. A response cut at max_response_length
("10" then more digits, or no EOS) earns nothing, which is what teaches the model to stop.
"""

from __future__ import annotations

import re
from typing import Optional

PEEK_CALL = "[p()]"
"""The peek task's call in SGLang's `pythonic` tool-call format (what its format credit compares against)."""
EOS_TEXT = "<|im_end|>"


def sum_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    if not extra_info or "finish_reason" not in extra_info:
        raise ValueError("mgrpo/sum needs extra_info['finish_reason'] ('stop' when the response ended with EOS)")
    text = solution_str
    if text.endswith("<eos>"):  # decoded without skip_special_tokens
        text = text[: -len("<eos>")]
    return 1.0 if extra_info["finish_reason"] == "stop" and text == str(ground_truth) else 0.0


def peek_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    """mgrpo/peek (multi-turn; extra_info['turns'] from the agent): 1.0 when the last assistant turn, without
    its think block, is exactly the hidden digit and ended on EOS. Otherwise format credit, at most 0.2, so that
    a random model, which almost never writes a whole call or a one-digit answer after it, has something to
    climb (`_shape`): at most 0.1 for the first turn on its way to the call (`PEEK_CALL`) then EOS (a turn
    cut by the length limit runs no tool), and at most 0.1 for a later turn (after the tool's reply) on its
    way to one digit then EOS. Chance (a guessed digit) is 0.1."""
    if not extra_info or "turns" not in extra_info:
        raise ValueError("mgrpo/peek is a multi-turn task: it needs extra_info['turns'] (rollout.multi_turn.enable)")
    answer = re.sub(r"<think>.*?</think>", "", solution_str, flags=re.S).strip()
    if extra_info.get("finish_reason") == "stop" and answer == str(ground_truth):
        return 1.0
    said = [t["text"] for t in extra_info["turns"]["turns"] if t["role"] == "assistant"]
    credit = _shape(said[0] if said else "", lambda body: _prefix(body, PEEK_CALL), len(PEEK_CALL))
    if len(said) > 1:  # a turn after the tool's reply: one digit, then EOS
        credit += _shape(said[-1], lambda body: int(body[:1].isdigit()), 1)
    return credit


def _prefix(body: str, target: str) -> int:
    return next((k for k, (a, b) in enumerate(zip(body, target)) if a != b), min(len(body), len(target)))


def _shape(turn: str, good, size: int) -> float:
    """At most 0.1, rising along the way to the target turn: its `size` target characters (`good(body)`: how
    many the turn starts with), then EOS right after them; minus 0.01 per 8 stray characters, floored at 0
    (so a turn that repeats its first right character everywhere, or stops before saying anything, gains
    little: both happened with gentler credits)."""
    ended = turn.endswith(EOS_TEXT)
    body = turn[:-len(EOS_TEXT)] if ended else turn
    same = good(body)
    stray = len(body) - same
    done = ended and same == size and stray == 0
    return max(0.0, 0.1 * (same + done) / (size + 1) - 0.01 * stray / 8)
