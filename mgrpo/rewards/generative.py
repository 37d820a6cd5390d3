"""Generative judges (reward.models.<name>.kind=generative): a chat model asked, through its own chat template,
what the judge's template says about each response; its answer parsed to a score (judge.py holds the templates and
parsers). Its servers are hosted by an `EngineHosting` (hosting.py), as a classifier reward model's are; an
OpenAI-compatible endpoint (judge.openai_url) is called through the openai client instead, with no hosting.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from mgrpo.config.reward import RewardModelConfig
from mgrpo.rewards import judge
from mgrpo.rewards.hosting import EngineHosting, EngineKit
from mgrpo.rewards.scoring import FAILED, OK, TIMEOUT, ScoreRequest, ScoreResult


class GenerativeJudge:
    """A chat model as a judge (kind=generative, rewards/judge.py): each response (pairwise: each order of response
    and reference) rendered into the judge's template, formatted with the judge model's own chat template and sent
    to its engines' /generate as token ids (or, judge.openai_url, to an OpenAI-compatible /chat/completions through
    the openai client, which owns that call's timeout and retries); the answer parsed to a score. A request that
    fails (timeout, 5xx, a dead engine, each retried within max_retries by the client) or an answer the parser
    refuses leaves the sample without a score, never 0: counted per judge (reward/<name>/unparsed) and masked."""

    label = "judge"

    def __init__(self, name: str, cfg: RewardModelConfig, engines: Optional[EngineKit] = None, *,
                 api_key: Optional[str], log_dir: str, **where):
        """`engines`: how servers are started and reached (not needed with judge.openai_url); `where`: where they
        go (EngineHosting's placement, devices, cpus)."""
        j = cfg.judge
        self.name, self.cfg = name, cfg
        self.template = judge.template_of(f"reward.models.{name}.judge", j)
        self.counts = {"unparsed": 0, "disagreements": 0, "judgements": 0}
        self.openai = None
        self.hosting: Optional[EngineHosting] = None
        self.tokenizer = None
        if j.openai_url:
            try:
                from openai import OpenAI
            except ImportError:
                from mgrpo.config import ConfigError

                raise ConfigError(f"reward.models.{name}.judge.openai_url needs the openai package "
                                  "(pip install openai)") from None

            key = os.environ.get(j.api_key_env) if j.api_key_env else None
            # the openai client retries connection errors, 408/409/429 and 5xx with exponential backoff
            self.openai = OpenAI(base_url=j.openai_url, api_key=key or "none", timeout=cfg.timeout_s,
                                 max_retries=cfg.max_retries)
            return
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.hf_path)
        if j.parser == "yes_no":  # checked before any server starts
            self.yes_no_ids = tuple(self._one_token(f"reward.models.{name}.judge.{k}", t)
                                    for k, t in (("yes", j.yes), ("no", j.no)))
        # Several judge servers sit behind SGLang's router, which takes one prompt per /generate request.
        self.hosting = EngineHosting(name, cfg, engines, api_key=api_key, log_dir=log_dir, server_flags=(),
                                     routed=True, label=self.label, **where)

    @property
    def restarts(self) -> int:
        return self.hosting.restarts if self.hosting is not None else 0

    def _one_token(self, where: str, text: str) -> int:
        from mgrpo.config import ConfigError

        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ConfigError(f"{where}={text!r} is {len(ids)} tokens of {self.cfg.hf_path}'s tokenizer ({ids}); "
                              "the yes/no parser reads one token's probability")
        return ids[0]

    def messages(self, user: str) -> list[dict]:
        system = self.cfg.judge.system
        return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]

    def prompts(self, req: ScoreRequest) -> list[str]:
        """The judge's user message(s) for one request: one, or the two orders in pairwise mode."""
        render = judge.render
        j = self.cfg.judge
        rubric = str((req.extra_info or {}).get("rubric") or j.rubric)
        kw = dict(prompt=req.prompt, response=req.response, reference=req.ground_truth, rubric=rubric)
        if not j.pairwise:
            return [render(self.template, **kw)]
        ref = "" if req.ground_truth is None else str(req.ground_truth)
        return [render(self.template, pair=(req.response, ref), **kw),
                render(self.template, pair=(ref, req.response), **kw)]

    def _generate(self, engine, users: list[str]) -> list[tuple[str, list]]:
        """One /generate batch: (answer text, first position's top log-probs [(logprob, token_id)]) per message."""
        SGLangBadResponseError = self.hosting.kit.bad_response  # noqa: N806 - an exception class
        j, tok = self.cfg.judge, self.tokenizer
        ids = [tok.apply_chat_template(self.messages(u), tokenize=True, add_generation_prompt=True,
                                       return_dict=False) for u in users]
        yes_no = j.parser == "yes_no"
        sp = {"temperature": j.temperature, "max_new_tokens": 1 if yes_no else j.max_new_tokens}
        if tok.eos_token_id is not None:
            sp["stop_token_ids"] = [tok.eos_token_id]
        # SGLang's router takes no batches (it places each request): one prompt per request through it
        one = engine.unbatched
        if one and len(ids) != 1:
            raise ValueError(f"one prompt per request through the router, got {len(ids)}")
        body = {"input_ids": list(ids[0]) if one else [list(x) for x in ids], "sampling_params": sp}
        if yes_no:
            body.update(return_logprob=True, top_logprobs_num=j.top_logprobs)
        items = engine.client.json("POST", "/generate", body)
        items = [items] if one and isinstance(items, dict) else items
        if not isinstance(items, list) or len(items) != len(users):
            raise SGLangBadResponseError(f"/generate answered {type(items).__name__} for {len(users)} prompts")
        out = []
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("output_ids"), list):
                raise SGLangBadResponseError(f"/generate answered an item without output_ids: {str(item)[:200]}")
            text = tok.decode(item["output_ids"], skip_special_tokens=True)
            tops = (item.get("meta_info") or {}).get("output_top_logprobs") or [[]]
            out.append((text, [(float(v), int(t)) for v, t, *_ in (tops[0] or [])]))
        return out

    def _chat(self, user: str) -> tuple[str, list]:
        """One /chat/completions call: (answer text, first position's top log-probs [(logprob, token text)])."""
        j = self.cfg.judge
        yes_no = j.parser == "yes_no"
        kw = dict(logprobs=True, top_logprobs=j.top_logprobs) if yes_no else {}
        resp = self.openai.chat.completions.create(model=j.openai_model, messages=self.messages(user),
                                                   temperature=j.temperature,
                                                   max_tokens=1 if yes_no else j.max_new_tokens, **kw)
        choice = resp.choices[0]
        top = []
        if yes_no and choice.logprobs and choice.logprobs.content:
            top = [(float(t.logprob), t.token.strip()) for t in choice.logprobs.content[0].top_logprobs]
        return choice.message.content or "", top

    def _parse(self, text: str, top: list) -> float:
        j = self.cfg.judge
        lo, hi = float(j.range[0]), float(j.range[1])
        if j.parser == "yes_no":
            keys = self.yes_no_ids if self.openai is None else (j.yes.strip(), j.no.strip())
            return judge.p_yes(top, *keys)
        if j.parser == "json":
            return judge.parse_json(text, j.json_key, lo, hi)
        return judge.parse_number(text, j.pattern, lo, hi)

    def _ask(self, users: list[str]) -> tuple[list, ScoreResult]:
        """(text, top) or None per message, and the outcome of each (a failed call: 'timeout' or 'failed')."""
        by = f"{self.label}:{self.name}"
        if self.openai is None:  # through the hosting: several messages a request, or one each behind the router
            routed = self.hosting.front is not None
            return self.hosting.spread(len(users), 1 if routed else self.cfg.batch_size,
                                       self.cfg.judge.concurrency if routed else len(self.hosting.engines),
                                       lambda engine, idx: self._generate(engine, [users[i] for i in idx]), by=by)
        import openai

        n = len(users)
        answers: list = [None] * n
        failures: list[tuple[int, str, str]] = []

        def one(i: int) -> None:
            try:
                answers[i] = self._chat(users[i])
            except openai.APITimeoutError as e:
                failures.append((i, TIMEOUT, str(e)))
            except openai.OpenAIError as e:
                failures.append((i, FAILED, f"{type(e).__name__}: {e}"))

        with ThreadPoolExecutor(max_workers=max(1, min(self.cfg.judge.concurrency, n))) as pool:
            list(pool.map(one, range(n)))
        result = ScoreResult.empty(n)
        for i, status, error in sorted(failures):
            result.fail(i, status, by, error)
        return answers, result

    def _unparsed_hint(self) -> str:
        """Which keys decide whether an answer parses (named in the failure, and so in a refusal past max_rate)."""
        j, key = self.cfg.judge, f"reward.models.{self.name}.judge"
        if j.parser == "yes_no":
            return (f"; raise {key}.top_logprobs={j.top_logprobs} (the yes/no tokens must be among the first "
                    f"token's most likely), or change {key}.yes={j.yes!r} / {key}.no={j.no!r} or {key}.template")
        return f"; see {key}.parser={j.parser!r} and {key}.template (the answer must hold what the parser reads)"

    def score(self, reqs: Sequence[ScoreRequest]) -> ScoreResult:
        """A score or None per request; never raises for an engine's or a parser's failure."""
        j = self.cfg.judge
        self.counts = {"unparsed": 0, "disagreements": 0, "judgements": 0}  # this call's (the step's) counts
        per = [self.prompts(r) for r in reqs]
        flat = [u for p in per for u in p]
        out = ScoreResult.empty(len(reqs))
        if not flat:
            return out
        answers, asked = self._ask(flat)
        values: list[Optional[float]] = [None] * len(flat)
        for i, a in enumerate(answers):
            if a is None:
                continue
            try:
                values[i] = self._parse(*a)
            except judge.Unparsed as e:
                asked.fail(i, FAILED, f"{self.label}:{self.name}", f"unparsed answer: {e}{self._unparsed_hint()}")
                self.counts["unparsed"] += 1
        self.counts["judgements"] += len(flat)
        k = 0
        lo, hi = float(j.range[0]), float(j.range[1])
        for r, p in enumerate(per):
            idx = list(range(k, k + len(p)))
            k += len(p)
            bad = next((i for i in idx if asked.status[i] != OK), None)
            if bad is not None:
                out.fail(r, asked.status[bad], asked.failed_by[bad], "")
                continue
            if j.pairwise:
                first, swapped = (judge.preference(values[i], j.parser, lo, hi) for i in idx)
                out.scores[r], disagree = judge.swap_average(first, swapped)
                self.counts["disagreements"] += disagree
            else:
                out.scores[r] = values[idx[0]]
        out.errors = asked.errors
        out.measured = {f"reward/{self.name}/{key}": float(v) for key, v in self.counts.items()}
        return out

    def close(self) -> None:
        if self.openai is not None:
            self.openai.close()
        if self.hosting is not None:
            self.hosting.close()
