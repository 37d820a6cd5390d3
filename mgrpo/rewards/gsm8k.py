"""GSM8K: the number after the last '####', else the last number in the response.

veRL's default (strict) GSM8K judge requires '#### N' and compares strings; here the answer marker
is preferred but a response without it falls back to its last number (so an instruction-tuned
model that writes "The answer is 72." is not scored 0 for format alone), and numbers are compared
as numbers: '$1,234.', '1234' and '1234.00' are the same answer.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

# A number with optional sign, '$', thousands commas and decimals. A trailing '.' (end of sentence)
# is not part of it because the decimal part needs digits.
_NUMBER = re.compile(r"-?\$?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)")


def _to_fraction(text: str) -> Optional[Fraction]:
    cleaned = text.replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(response: str) -> Optional[str]:
    """The answer string the judge will compare (see module docstring), or None."""
    if "####" in response:
        m = _NUMBER.search(response.rsplit("####", 1)[1])
        if m:
            return m.group(0)
    numbers = _NUMBER.findall(response)
    return numbers[-1] if numbers else None


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None) -> float:
    answer = extract_answer(solution_str)
    if answer is None:
        return 0.0
    got, want = _to_fraction(answer), _to_fraction(str(ground_truth))
    return 1.0 if got is not None and got == want else 0.0
