"""The GSM8K judge: veRL's rules (strict by default, flexible as reward.gsm8k.method) and its format credit
(reward.gsm8k.format_score), against hand-written responses and against veRL's own scorer (copied verbatim
to tests/data/verl_gsm8k.py) on every reference solution of GSM8K's test split."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess

import pytest

from mgrpo.config.schema import Gsm8kJudgeConfig, RewardConfig
from mgrpo.rewards import Rules, ScoreRequest
from mgrpo.rewards.gsm8k import compute_score, extract_solution
from tests.helpers import ROOT


GSM8K_TEST = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"


def verl_scorer():
    spec = importlib.util.spec_from_file_location("verl_gsm8k", ROOT / "tests" / "data" / "verl_gsm8k.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


# (response, ground truth, strict answer, flexible answer): written by hand from veRL's rules.
CASES = [
    ("... so she makes 18 dollars.\n#### 18", "18", "18", "18"),
    ("I think it's 72", "72", None, "72"),                    # no '#### ': strict finds no answer
    ("The answer is 72.", "72", None, "72."),                 # a sentence's '.' is part of the number ...
    ("#### 72.", "72", "72.", "72."),                         # ... in both modes (scored as a wrong answer)
    ("72 . ", "72", None, "72"),                              # flexible skips a lone '.' 
    ("#### 1,234", "1234", "1234", "1,234"),                  # strict drops commas, flexible keeps them
    ("#### $5", "5", None, "5"),                              # '#### ' must be followed by the number
    ("####72", "72", None, "72"),                             # ... after exactly one space
    ("#### -3", "-3", "-3", "-3"),
    ("#### 18\nbut wait, #### 19", "18", "19", "19"),        # the last one counts
    ("#### 18 (because 3 * 6 = 18, not 20)", "18", "18", "20"),
    ("no number at all", "18", None, None),
    ("", "18", None, None),
    ("x" * 400 + " #### 7", "7", "7", "7"),                  # only the last 300 characters are read
    ("#### 7 " + "x" * 400, "7", None, None),
    ("a. b.", "1", None, "."),                                # every match a lone '.': veRL returns the first
]


@pytest.mark.parametrize("response, truth, strict, flexible", CASES)
def test_answers_and_scores_by_hand(response, truth, strict, flexible):
    assert extract_solution(response, "strict") == strict
    assert extract_solution(response, "flexible") == flexible
    for method, answer in (("strict", strict), ("flexible", flexible)):
        for credit in (0.0, 0.1):
            want = 0.0 if answer is None else 1.0 if answer == truth else credit
            assert compute_score("openai/gsm8k", response, truth, None, method=method, format_score=credit) == want
    # the default is veRL's: strict, no format credit
    assert compute_score("openai/gsm8k", response, truth) == (1.0 if strict == truth else 0.0)


def test_the_issue_examples():
    assert compute_score("openai/gsm8k", "I think it's 72", "72") == 0.0
    assert compute_score("openai/gsm8k", "I think it's 72", "72", method="flexible") == 1.0
    assert compute_score("openai/gsm8k", "#### 71", "72", format_score=0.1) == pytest.approx(0.1)
    assert compute_score("openai/gsm8k", "I think it's 71", "72", format_score=0.1) == 0.0


def _reference_cases():
    cases = [(r, t) for r, t, _, _ in CASES]
    if GSM8K_TEST.exists():
        for line in GSM8K_TEST.read_text().splitlines():
            answer = json.loads(line)["answer"]
            truth = answer.rsplit("####", 1)[1].strip().replace(",", "")
            cases += [(answer, truth), (answer.rsplit("####", 1)[0], truth),     # the solution without its answer line
                      (answer + "0", truth), ("The answer is " + truth, truth)]
    return cases


def test_equals_verls_scorer():
    """Every hand-written response, and each GSM8K test solution as written, cut before '####', with a wrong
    answer and in plain words: the same score as veRL's function, in both modes, with and without format credit."""
    verl = verl_scorer()
    cases = _reference_cases()
    assert len(cases) > 5000 or not GSM8K_TEST.exists()
    for response, truth in cases:
        for method in ("strict", "flexible"):
            for credit in (0.0, 0.1):
                ours = compute_score("openai/gsm8k", response, truth, None, method=method, format_score=credit)
                assert ours == verl(response, truth, method=method, format_score=credit), (response[-80:], method)
    if GSM8K_TEST.exists():  # each reference solution, as written, is right under the strict judge
        solutions = cases[len(CASES)::4]
        assert len(solutions) == 1319 and all(compute_score("openai/gsm8k", r, t) == 1.0 for r, t in solutions)


@pytest.mark.integration
@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_judger_applies_reward_gsm8k(num_workers):
    requests = [ScoreRequest("openai/gsm8k", r, t) for r, t in
                [("#### 72", "72"), ("#### 71", "72"), ("I think it's 72", "72"), ("nothing", "72")]]
    for method, credit, want in (("strict", 0.0, [1.0, 0.0, 0.0, 0.0]), ("strict", 0.1, [1.0, 0.1, 0.0, 0.0]),
                                 ("flexible", 0.1, [1.0, 0.1, 1.0, 0.0])):
        cfg = RewardConfig(gsm8k=Gsm8kJudgeConfig(method=method, format_score=credit), num_workers=num_workers,
                           isolate_builtin_rules=num_workers > 0)  # the workers are sent reward.gsm8k too
        with Rules(cfg) as judger:
            assert judger.score(requests).scores == pytest.approx(want), (method, credit)


@pytest.mark.integration
def test_reward_gsm8k_is_a_config_key():
    base = dict(capture_output=True, text=True, timeout=120, env=dict(os.environ))
    out = subprocess.run(["mgrpo-train", "reward.gsm8k.method=flexible", "reward.gsm8k.format_score=0.1",
                          "--cfg", "job"], **base)
    assert out.returncode == 0, out.stderr
    assert "gsm8k:\n    method: flexible\n    format_score: 0.1" in out.stdout
    bad = subprocess.run(["mgrpo-train", "reward.gsm8k.method=loose", "--cfg", "job"], **base)
    assert bad.returncode != 0 and "reward.gsm8k.method" in bad.stderr and "strict" in bad.stderr
