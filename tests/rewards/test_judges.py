"""Generative judges, in-process: the parsers on hand-written answers, the template's variables and refusals, the
yes/no probability from top log-probs, and position-swap averaging (mgrpo/rewards/judge.py); the config's refusals."""

from __future__ import annotations

import math

import pytest

from mgrpo.config import ConfigError
from mgrpo.config.checks import reward_model_errors
from mgrpo.config.reward import JudgeConfig, RewardConfig, RewardModelConfig
from mgrpo.rewards import judge
from mgrpo.rewards.judge import Unparsed


@pytest.mark.parametrize("text,want", [
    ("The response is correct.\nScore: 8", 8.0),
    ("Step 1 gives 3 points, step 2 gives 4. Final score: 7.5", 7.5),  # the last number
    ("Score: 10", 10.0),
    ("score 0", 0.0),
])
def test_number_parser_takes_the_last_match(text, want):
    assert judge.parse_number(text, r"(-?\d+(?:\.\d+)?)", 0.0, 10.0) == want


def test_number_parser_with_a_pattern_of_its_own():
    text = "I give 3 of 5 for style. Rating: [[4]]"
    assert judge.parse_number(text, r"\[\[(\d+)\]\]", 1.0, 5.0) == 4.0
    with pytest.raises(Unparsed, match="no score matching"):
        judge.parse_number("Rating: four", r"\[\[(\d+)\]\]", 1.0, 5.0)


@pytest.mark.parametrize("text,why", [
    ("I cannot judge this.", "no score matching"),
    ("Score: 11", "outside the judge's range"),
    ("Score: -1", "outside the judge's range"),
    ("", "no score matching"),
])
def test_number_parser_refuses_garbage_and_out_of_range(text, why):
    with pytest.raises(Unparsed, match=why):
        judge.parse_number(text, r"(-?\d+(?:\.\d+)?)", 0.0, 10.0)


def test_json_parser():
    assert judge.parse_json('Reasoning... {"score": 6, "why": "ok"}', "score", 0, 10) == 6.0
    assert judge.parse_json('```json\n{"verdict": {"x": 1}, "score": "2.5"}\n```', "score", 0, 10) == 2.5
    # the last object holding the key wins; an object without it is passed over
    assert judge.parse_json('{"score": 1} then {"score": 9} {"other": 3}', "score", 0, 10) == 9.0
    for text, why in [('{"score": "high"}', "not a number"), ('{"score": true}', "not a number"),
                      ('{"score": 12}', "outside"), ('{"rating": 3}', "no JSON object"), ("{broken", "no JSON"),
                      ('{"score": NaN}', "outside")]:
        with pytest.raises(Unparsed, match=why):
            judge.parse_json(text, "score", 0, 10)


def test_yes_no_probability_from_top_logprobs():
    y, n = math.log(0.6), math.log(0.2)
    top = [(y, 7), (math.log(0.15), 3), (n, 9)]
    assert judge.p_yes(top, 7, 9) == pytest.approx(0.6 / 0.8, abs=1e-12)
    assert judge.p_yes(top, 9, 7) == pytest.approx(0.2 / 0.8, abs=1e-12)
    assert judge.p_yes([(y, 7), (-1.0, 3)], 7, 9) == 1.0  # no is below every returned token
    assert judge.p_yes([(y, 3), (n, 9)], 7, 9) == 0.0
    assert judge.p_yes([(-1e-9, "Yes"), (-30.0, "No")], "Yes", "No") == pytest.approx(1.0 / (1.0 + math.exp(-30.0)))
    with pytest.raises(Unparsed, match="neither the yes token"):
        judge.p_yes([(y, 3), (n, 4)], 7, 9)


def test_swap_averaging_and_disagreement():
    # the response preferred in both orders: 0.8 as A, the reference 0.3 as A (so 0.7 for the response as B)
    assert judge.swap_average(0.8, 0.3) == (pytest.approx(0.75), False)
    # position bias: A wins whichever it is -> the orders disagree, the mean is near 0.5
    value, disagree = judge.swap_average(0.9, 0.8)
    assert value == pytest.approx(0.55) and disagree
    assert judge.preference(7.5, "number", 0.0, 10.0) == 0.75
    assert judge.preference(3.0, "json", 1.0, 5.0) == 0.5
    assert judge.preference(0.25, "yes_no", 0.0, 10.0) == 0.25


def test_template_variables_and_refusals(tmp_path):
    cfg = JudgeConfig(template="Q: {{ question }}\nA: {{ response }}\nRef: {{ reference }}\n{{ rubric }}")
    t = judge.template_of("reward.models.j.judge", cfg)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+2="}]
    assert judge.render(t, prompt=msgs, response="3", reference=3, rubric="exact") == "Q: 1+2=\nA: 3\nRef: 3\nexact"
    assert judge.render(t, prompt="2+2=", response="4", reference=None, rubric="") == "Q: 2+2=\nA: 4\nRef: \n"
    pair = JudgeConfig(template="{{ response_a }} vs {{ response_b }}", pairwise=True)
    assert judge.render(judge.template_of("w", pair), prompt="", response="x", reference="y", rubric="",
                        pair=("x", "y")) == "x vs y"
    # a variable a judge does not give, a syntax error (with its line), a pairwise template without the pair
    with pytest.raises(ConfigError, match=r"reward.models.j.judge.template: UndefinedError: 'answer' is undefined"):
        judge.template_of("reward.models.j.judge", JudgeConfig(template="{{ answer }}"))
    f = tmp_path / "judge.j2"
    f.write_text("line one\n{% if response %}\n{{ response }\n")
    with pytest.raises(ConfigError, match=rf"template_file={f} line 3: TemplateSyntaxError"):
        judge.template_of("reward.models.j.judge", JudgeConfig(template_file=str(f)))
    with pytest.raises(ConfigError, match="'response_a' is undefined"):
        judge.template_of("w", JudgeConfig(template="{{ response_a }}"))
    with pytest.raises(ConfigError, match="'response' is undefined"):
        judge.template_of("w", JudgeConfig(template="{{ response }}", pairwise=True))
    # the sandbox: a template cannot reach Python's internals
    with pytest.raises(ConfigError, match="SecurityError"):
        judge.template_of("w", JudgeConfig(template="{{ response.__class__.__mro__[1].__subclasses__() }}"))


def test_config_refusals_name_the_key(monkeypatch):
    monkeypatch.delenv("JUDGE_KEY_FOR_TEST", raising=False)
    bad = JudgeConfig(template="x", template_file="/nonexistent/judge.j2", parser="words", pattern="([",
                      range=[5.0, 1.0], max_new_tokens=0, openai_url="ftp://x", api_key_env="JUDGE_KEY_FOR_TEST")
    errors = reward_model_errors(RewardConfig(models={"j": RewardModelConfig(kind="generative", judge=bad)}))
    text = "\n".join(errors)
    for want in ["reward.models.j.judge: give exactly one of template (inline) and template_file",
                 "reward.models.j.judge.template_file=/nonexistent/judge.j2: no such file",
                 "reward.models.j.judge.parser='words' is not one of ['number', 'json', 'yes_no']",
                 "reward.models.j.judge.range=[5.0, 1.0]", "max_new_tokens=0",
                 "reward.models.j.judge.openai_url='ftp://x'", "openai_model is empty",
                 "api_key_env=JUDGE_KEY_FOR_TEST: the variable is not set"]:
        assert want in text, (want, text)
    # a pattern is checked when the number parser reads it
    errors = reward_model_errors(RewardConfig(models={"j": RewardModelConfig(
        kind="generative", hf_path="x", judge=JudgeConfig(template="x", pattern="(["))}))
    assert any("reward.models.j.judge.pattern='(['" in e for e in errors)
    # an OpenAI endpoint needs no hf_path; yes == no is refused
    ok = JudgeConfig(template="{{ response }}", openai_url="http://h/v1", openai_model="m")
    assert reward_model_errors(RewardConfig(models={"j": RewardModelConfig(kind="generative", judge=ok)})) == []
    same = JudgeConfig(template="{{ response }}", parser="yes_no", yes="Y", no="Y")
    assert any("two different tokens" in e for e in reward_model_errors(
        RewardConfig(models={"j": RewardModelConfig(kind="generative", hf_path="x", judge=same)})))
