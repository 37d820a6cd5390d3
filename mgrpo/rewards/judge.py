"""Generative judges (LLM-as-a-judge): the prompt a judge model reads, and how its answer becomes a score.

The template is Jinja (sandboxed, StrictUndefined: a variable the template names but the judge does not give is an
error, never an empty string). Its variables: `question` (the record's last user message, or the prompt text),
`messages` (the record's prompt messages), `response`, `reference` (the record's ground truth), `rubric`
(reward.models.<name>.judge.rubric, or the record's extra_info.rubric); in pairwise mode `response_a` and
`response_b` instead of `response`.

Parsers (judge.parser), each returning a score or raising `Unparsed` (a failed judgement, never 0.0):
- number: the last match of judge.pattern (its first group) in the answer, range-checked against judge.range;
- json: judge.json_key of the last JSON object in the answer (a finite number within judge.range);
- yes_no: P(yes) / (P(yes) + P(no)) at the answer's first position, from the top log-probs the engine returns
  (SGLang's output_top_logprobs, OpenAI's top_logprobs). A token outside the returned top-k counts as probability
  0 (its probability is below every returned one); both outside is a failed judgement.

Pairwise mode scores a response against the reference in both orders (A=response, B=reference, then swapped):
each order's preference for the response in [0, 1] (a number or JSON value scaled from judge.range, yes_no as is),
the score their mean, and the two orders disagreeing (one above 0.5, the other below) counted: position bias.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Optional, Sequence


class Unparsed(ValueError):
    """The judge's answer holds no score the parser accepts (garbage, out of range, neither yes nor no)."""


def environment():
    from jinja2 import StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    return SandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True)


def compile_template(text: str):
    """A Jinja template; raises jinja2.TemplateSyntaxError (with its line) for a malformed one."""
    return environment().from_string(text)


def template_of(where: str, cfg) -> Any:
    """reward.models.<name>.judge's template (inline or from its file), compiled and rendered once with stand-in
    values so that a syntax error or a variable no judge gives is a ConfigError naming the key and line."""
    from mgrpo.config import ConfigError

    text, src = cfg.template, f"{where}.template"
    if cfg.template_file:
        src = f"{where}.template_file={cfg.template_file}"
        try:
            with open(cfg.template_file, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise ConfigError(f"{src}: cannot be read ({err.strerror})") from None
    try:
        template = compile_template(text)
        render(template, prompt="q", response="r", reference="ref", rubric="rubric",
               pair=("A", "B") if cfg.pairwise else None)
    except Exception as err:  # noqa: BLE001 - Jinja's syntax and undefined-variable errors
        line = getattr(err, "lineno", None)
        names = "response_a, response_b" if cfg.pairwise else "response"
        raise ConfigError(f"{src}{f' line {line}' if line else ''}: {type(err).__name__}: {err} (a judge's template "
                          f"has question, messages, reference, rubric and {names})") from None
    return template


def check_judges(cfg) -> None:
    """Every generative judge's template (reward.models.<name>.judge), before any process starts."""
    for name, m in cfg.models.items():
        if m.kind == "generative":
            template_of(f"reward.models.{name}.judge", m.judge)


def question_of(prompt: Any) -> str:
    """The question a judge is shown: the last user message of chat messages, or the prompt text."""
    if isinstance(prompt, list):
        users = [m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        return str(users[-1]) if users else ""
    return "" if prompt is None else str(prompt)


def render(template, *, prompt: Any, response: str, reference: Any, rubric: str,
           pair: Optional[tuple[str, str]] = None) -> str:
    """The judge's user message for one response (or, `pair`, for response_a / response_b)."""
    values = dict(question=question_of(prompt), messages=prompt if isinstance(prompt, list) else [],
                  reference="" if reference is None else str(reference), rubric=rubric)
    if pair is None:
        values["response"] = response
    else:
        values["response_a"], values["response_b"] = pair
    return template.render(**values)


def _in_range(value: float, lo: float, hi: float, what: str) -> float:
    if not math.isfinite(value) or not lo <= value <= hi:
        raise Unparsed(f"{what} {value} is outside the judge's range [{lo}, {hi}]")
    return value


def parse_number(text: str, pattern: str, lo: float, hi: float) -> float:
    """The last match of `pattern` (its first group, or the whole match) as a float in [lo, hi]."""
    found = list(re.finditer(pattern, text))
    if not found:
        raise Unparsed(f"no score matching {pattern!r} in the answer {text[-200:]!r}")
    m = found[-1]
    raw = m.group(1) if m.groups() else m.group(0)
    try:
        value = float(raw)
    except ValueError:
        raise Unparsed(f"{raw!r} (matching {pattern!r}) is not a number") from None
    return _in_range(value, lo, hi, "the score")


def parse_json(text: str, key: str, lo: float, hi: float) -> float:
    """judge.json_key of the last JSON object in the answer (fenced in ``` or not), a finite number in [lo, hi]."""
    decoder = json.JSONDecoder()
    found = None
    for start in (i for i, c in enumerate(text) if c == "{"):
        try:
            obj, _ = decoder.raw_decode(text, start)
        except ValueError:
            continue
        if isinstance(obj, dict) and key in obj:
            found = obj
    if found is None:
        raise Unparsed(f"no JSON object with {key!r} in the answer {text[-200:]!r}")
    value = found[key]
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise Unparsed(f"{key}={value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Unparsed(f"{key}={value!r} is not a number")
    return _in_range(float(value), lo, hi, f"{key}")


def p_yes(top: Sequence[tuple[float, int]], yes_id: int, no_id: int) -> float:
    """P(yes) / (P(yes) + P(no)) from one position's top log-probs [(logprob, token_id), ...]. A token not among
    them counts as probability 0; neither among them is a failed judgement."""
    lp = {t: v for v, t in top}
    if yes_id not in lp and no_id not in lp:
        raise Unparsed(f"neither the yes token ({yes_id}) nor the no token ({no_id}) is among the {len(lp)} most "
                       "likely first tokens")
    if yes_id not in lp:
        return 0.0
    if no_id not in lp:
        return 1.0
    y, n = lp[yes_id], lp[no_id]
    return 1.0 / (1.0 + math.exp(n - y))  # exp(y) / (exp(y) + exp(n)), stable


def preference(score: float, parser: str, lo: float, hi: float) -> float:
    """A parsed score as a preference in [0, 1] (yes_no already is one)."""
    return score if parser == "yes_no" else (score - lo) / (hi - lo)


def swap_average(first: float, swapped: float) -> tuple[float, bool]:
    """Pairwise with position swap: `first` = the preference for the response shown as A, `swapped` = the
    preference for the reference shown as A. Returns (the response's mean preference, whether the orders disagree)."""
    other = 1.0 - swapped
    disagree = (first - 0.5) * (other - 0.5) < 0
    return 0.5 * (first + other), disagree
