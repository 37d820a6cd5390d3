"""Generative judges against the real CPU server (launched as the run launches reward engines) and the real
tokenizer's chat template: the yes/no probability equals a softmax computed from transformers' own forward of the
same checkpoint, pairwise position-swap averaging and its disagreements match that reference, the number parser
reads what greedy decoding of the reference writes, and every failure (garbage, 5xx, a hung server, a killed
engine) leaves the sample without a score (never 0.0), counted; a killed engine is started again."""

from __future__ import annotations

import os

import pytest
import torch

from mgrpo.cluster.ray_env import stop_ray
from mgrpo.cluster.aux_engines import RewardEngines
from mgrpo.rewards.generative import GenerativeJudge
from mgrpo.rewards import Rubric
from mgrpo.config.reward import JudgeConfig, RewardConfig, RewardModelConfig
from mgrpo.config.schema import ModelConfig
from mgrpo.data.printable import printable_tokenizer
from mgrpo.models.hf_io import init_hf_checkpoint
from mgrpo.rewards import Rules, ScoreRequest
from mgrpo.rewards.judge import compile_template, parse_number, render, Unparsed
from tests.helpers.procs import kill_and_wait
from tests.helpers.sglang_cpu import FaultProxy

ENGINES = RewardEngines()

YES_NO = "Q:{{ question }}\nA:{{ response }}\nRight? Y or N"
PAIR = "Q:{{ question }}\n1:{{ response_a }}\n2:{{ response_b }}\nIs 1 better? Y or N"
NUMBER = "Q:{{ question }}\nA:{{ response }}\nRef:{{ reference }}\nScore 0-9:"


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory):
    """A tiny Qwen3-shaped chat model on the printable tokenizer (its chat template), served once for the module."""
    d = str(tmp_path_factory.mktemp("judge"))
    cfg = ModelConfig(tokenizer="printable", vocab_size=107, max_position_embeddings=512, init_std=0.1)
    init_hf_checkpoint(d, cfg, seed=0, tokenizer=printable_tokenizer())
    base = GenerativeJudge("judge", RewardModelConfig(kind="generative", hf_path=d, timeout_s=60, judge=JudgeConfig(
        template=YES_NO, parser="yes_no", yes="Y", no="N", top_logprobs=107)), engines=ENGINES, api_key=None, log_dir=d)
    try:
        yield d, base
    finally:
        base.close()
        stop_ray()  # the judge engine's host ran in the local Ray its start brought up


def requests_():
    return [ScoreRequest("mgrpo/sum", r, gt, extra_info={"finish_reason": "stop"}, prompt=[{"role": "user", "content": q}])
            for q, r, gt in [("1+2=", "3", "3"), ("4+4=", "9", "8"), ("2+0=", "2", "2"), ("3+1=", "so 4", "4")]]


class Reference:
    def __init__(self, hf_dir: str):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self.tok = printable_tokenizer()

    def ids(self, user: str) -> list[int]:
        return self.tok.apply_chat_template([{"role": "user", "content": user}], tokenize=True,
                                            add_generation_prompt=True, return_dict=False)

    @torch.no_grad()
    def next_logprobs(self, ids: list[int]) -> torch.Tensor:
        return torch.log_softmax(self.model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)

    def p_yes(self, user: str) -> float:
        lp = self.next_logprobs(self.ids(user))
        y, n = (self.tok.convert_tokens_to_ids(t) for t in ("Y", "N"))
        return float(torch.exp(lp[y]) / (torch.exp(lp[y]) + torch.exp(lp[n])))

    def greedy(self, user: str, max_new: int) -> str:
        ids, out = self.ids(user), []
        for _ in range(max_new):
            t = int(torch.argmax(self.next_logprobs(ids + out)))
            out.append(t)
            if t == self.tok.eos_token_id:
                break
        return self.tok.decode(out, skip_special_tokens=True)


def connect(base: GenerativeJudge, url: str | None = None, **judge) -> GenerativeJudge:
    cfg = RewardModelConfig(kind="generative", hf_path=base.cfg.hf_path, url=url or base.hosting.engines[0].url,
                            timeout_s=judge.pop("timeout_s", 60), max_retries=judge.pop("max_retries", 2),
                            judge=JudgeConfig(**judge))
    return GenerativeJudge("judge", cfg, engines=ENGINES, api_key=None, log_dir=base.hosting.log_dir)


@pytest.mark.integration
def test_yes_no_and_pairwise_equal_the_models_own_softmax(judge_model):
    hf_dir, base = judge_model
    ref, reqs = Reference(hf_dir), requests_()

    # the server's top log-probs are the model's own most likely next tokens (torch.topk of its log-softmax)
    user = render(compile_template(YES_NO), prompt=reqs[0].prompt, response="3", reference="3", rubric="")
    got = base.hosting.engines[0].client.json("POST", "/generate", {
        "input_ids": ref.ids(user), "sampling_params": {"temperature": 0, "max_new_tokens": 1},
        "return_logprob": True, "top_logprobs_num": 5})
    want = torch.topk(ref.next_logprobs(ref.ids(user)), 5)
    top = got["meta_info"]["output_top_logprobs"]
    assert len(top) == 1 and [t for _, t, _ in top[0]] == want.indices.tolist()
    assert max(abs(v - w) for (v, _, _), w in zip(top[0], want.values.tolist())) <= 1e-5

    got = base.score(reqs)
    scores, status = got.scores, got.status
    assert status == ["ok"] * 4 and got.errors == [] and got.failed_by == [""] * 4
    t = compile_template(YES_NO)
    expect = [ref.p_yes(render(t, prompt=r.prompt, response=r.response, reference=r.ground_truth, rubric=""))
              for r in reqs]
    assert max(abs(a - b) for a, b in zip(scores, expect)) <= 1e-5
    assert len({round(s, 3) for s in scores}) > 1  # different answers, different probabilities

    pair = connect(base, template=PAIR, parser="yes_no", yes="Y", no="N", top_logprobs=107, pairwise=True)
    got = pair.score(reqs)
    scores, status = got.scores, got.status
    t = compile_template(PAIR)
    want, disagree = [], 0
    for r in reqs:
        kw = dict(prompt=r.prompt, response=r.response, reference=r.ground_truth, rubric="")
        first = ref.p_yes(render(t, pair=(r.response, r.ground_truth), **kw))
        swapped = ref.p_yes(render(t, pair=(r.ground_truth, r.response), **kw))
        want.append(0.5 * (first + 1 - swapped))
        disagree += (first > 0.5) != (1 - swapped > 0.5)
    assert status == ["ok"] * 4 and max(abs(a - b) for a, b in zip(scores, want)) <= 1e-5
    assert pair.counts == {"unparsed": 0, "disagreements": disagree, "judgements": 8}


@pytest.mark.integration
def test_number_parser_garbage_5xx_hang_and_a_killed_engine(judge_model, tmp_path):
    hf_dir, base = judge_model
    ref, reqs = Reference(hf_dir), requests_()
    spec = dict(template=NUMBER, parser="number", pattern=r"(\d)", range=[0.0, 9.0], max_new_tokens=8)
    num = connect(base, **spec)
    got = num.score(reqs)
    scores, status = got.scores, got.status
    t = compile_template(NUMBER)
    for r, s, st, by in zip(reqs, scores, status, got.failed_by):
        answer = ref.greedy(render(t, prompt=r.prompt, response=r.response, reference=r.ground_truth, rubric=""), 8)
        try:
            assert (s, st) == (parse_number(answer, r"(\d)", 0.0, 9.0), "ok"), answer
        except Unparsed:  # the answer holds no digit: a failed judgement, never 0.0
            assert s is None and st == "failed" and by == "judge:judge", (answer, by)
            assert any("unparsed answer" in e for e in got.errors), got.errors
    assert num.counts["unparsed"] == sum(st == "failed" for st in status)

    # through the composed judger: a failed judgement is masked and counted per judge, never a label
    with FaultProxy(base.hosting.engines[0].url) as proxy:
        composed = Rubric(RewardConfig(num_workers=0, compose={"mgrpo/sum": {"judge": 1.0}}),
                                  Rules(RewardConfig(num_workers=0)), {"judge": connect(base, proxy.url, **spec)})
        proxy.garbage["/generate"] = [b'[{"text": "9"}, 5, {}, {}]']  # 200, but not SGLang's answer
        got = composed.score(reqs)
        assert got.scores == [None] * 4 and got.status == ["failed"] * 4 and got.failed_by == ["judge:judge"] * 4
        assert got.failed == 4 and got.components["judge"] == [None] * 4 and "output_ids" in got.errors[0]
        assert got.components["rule"] == [1.0, 0.0, 1.0, 0.0]  # the rule (weight 0) still reported beside it
        proxy.inject["/generate"] = [500, 503, 502]  # past max_retries=2: failed after 3 attempts
        got = composed.score(reqs)
        assert got.status == ["failed"] * 4 and got.scores == [None] * 4 and "HTTP 502" in got.errors[0], got.errors
        assert proxy.inject["/generate"] == []
        proxy.inject["/generate"] = [503]  # one 5xx: retried, then scored as without the fault
        got = composed.score(reqs)
        assert got.scores == scores and got.failed == scores.count(None) and got.status == status
        hung = connect(base, proxy.url, timeout_s=1.0, max_retries=0, **spec)
        proxy.delay["/generate"] = [3.0]
        assert hung.score(reqs[:1]).status == ["timeout"]
        composed.close()

    # a judge engine killed mid-run: the next scoring call starts it again and scores as before
    own = GenerativeJudge("judge", RewardModelConfig(kind="generative", hf_path=hf_dir, timeout_s=60,
                                                     judge=JudgeConfig(**spec)),
                          engines=ENGINES, api_key=None, log_dir=str(tmp_path))
    try:
        pid = own.hosting.addresses[0]["pid"]
        kill_and_wait(pid)
        got = own.score(reqs)
        again, status = got.scores, got.status
        new = own.hosting.addresses[0]["pid"]
        assert own.restarts == 1 and new != pid and os.path.exists(f"/proc/{new}")
        assert again == scores and status == [("ok" if s is not None else "failed") for s in scores]
    finally:
        own.close()


class ChatEndpoint:
    """A stand-in OpenAI-compatible /v1/chat/completions (the judge's other front door) that answers from a script
    and records what it was sent: the real openai client is under test, not the endpoint."""

    def __init__(self, answers: list):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.answers, self.seen = list(answers), []
        me = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                me.seen.append((self.path, self.headers.get("Authorization"), body))
                status, content, top = me.answers.pop(0)
                if status != 200:
                    data = json.dumps({"error": {"message": "injected"}}).encode()
                else:
                    lp = {"content": [{"token": "x", "logprob": 0.0, "bytes": None, "top_logprobs": [
                        {"token": t, "logprob": v, "bytes": None} for t, v in top]}]} if top else None
                    data = json.dumps({"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                                       "choices": [{"index": 0, "finish_reason": "stop", "logprobs": lp, "message":
                                                    {"role": "assistant", "content": content}}]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.integration
def test_openai_compatible_judge_key_from_the_environment_retries_and_parsers(monkeypatch):
    import math

    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test-123")
    reqs = requests_()[:2]
    end = ChatEndpoint([(500, "", None), (200, "Score: 7", None), (200, "no idea", None)])
    cfg = RewardModelConfig(kind="generative", timeout_s=10, max_retries=1, judge=JudgeConfig(
        template=NUMBER, system="You grade.", openai_url=end.url, openai_model="judge-m", api_key_env="JUDGE_TEST_KEY",
        concurrency=1))
    j = GenerativeJudge("api", cfg, engines=ENGINES, api_key=None, log_dir="")
    try:
        got = j.score(reqs)
        assert got.scores == [7.0, None] and got.status == ["ok", "failed"] and got.failed_by == ["", "judge:api"]
        assert got.failed == 1 and "unparsed answer" in got.errors[0]
        assert j.counts["unparsed"] == 1 and len(end.seen) == 3  # the 500 retried once by the openai client
        path, auth, body = end.seen[1]
        assert path == "/v1/chat/completions" and auth == "Bearer sk-test-123" and body["model"] == "judge-m"
        assert body["messages"][0] == {"role": "system", "content": "You grade."}
        assert body["messages"][1]["content"] == render(compile_template(NUMBER), prompt=reqs[0].prompt,
                                                        response="3", reference="3", rubric="")
        assert "sk-test-123" not in repr(j.__dict__.get("cfg"))  # the key lives in the environment only
        j.close()
        # yes/no from OpenAI's top_logprobs (token text), and a 5xx past the retry budget: failed, no score
        end.answers = [(200, "Y", [(" Y", math.log(0.3)), ("N", math.log(0.1))]), (503, "", None), (503, "", None)]
        yn = GenerativeJudge("api", RewardModelConfig(kind="generative", timeout_s=10, max_retries=1, judge=JudgeConfig(
            template=YES_NO, parser="yes_no", yes="Y", no="N", openai_url=end.url, openai_model="judge-m",
            concurrency=1)), engines=ENGINES, api_key=None, log_dir="")
        got = yn.score(reqs)
        assert got.scores[0] == pytest.approx(0.75) and got.scores[1] is None and got.status == ["ok", "failed"]
        assert end.seen[3][2]["logprobs"] is True and end.seen[3][2]["top_logprobs"] == 20
        assert end.seen[3][2]["max_tokens"] == 1
        yn.close()
    finally:
        end.close()


@pytest.mark.integration
def test_a_yes_no_judge_whose_tokens_are_not_among_its_top_logprobs_is_refused_in_one_line_naming_the_key():
    """Past reward.failed.max_rate the refusal names judge.top_logprobs (what decides whether Y/N are seen)."""
    from mgrpo.config.reward import FailedSamplesConfig
    from mgrpo.rewards import FailureRateExceeded, judge_batch

    reqs = requests_()
    end = ChatEndpoint([(200, "maybe", [("maybe", -0.1), ("x", -3.0)])] * len(reqs))
    cfg = RewardConfig(num_workers=0, compose={"mgrpo/sum": {"yn": 1.0}})
    yn = GenerativeJudge("yn", RewardModelConfig(kind="generative", timeout_s=10, max_retries=0, judge=JudgeConfig(
        template=YES_NO, parser="yes_no", yes="Y", no="N", top_logprobs=2, openai_url=end.url, openai_model="m",
        concurrency=1)), api_key=None, log_dir="")
    rubric = Rubric(cfg, Rules(cfg), {"yn": yn})
    try:
        with pytest.raises(FailureRateExceeded) as got:
            judge_batch(rubric, reqs, [0, 0, 1, 1], [], [], FailedSamplesConfig(max_rate=0.5))
    finally:
        rubric.close()
        end.close()
    line = str(got.value)
    assert "\n" not in line and line.startswith("4 of 4 samples (100%) have no reward (judge:yn 4)")
    assert "Change reward.models.yn.judge.top_logprobs, reward.models.yn.judge.yes, reward.models.yn.judge.no" in line
    assert "raise reward.models.yn.judge.top_logprobs=2" in line  # the example error says what it is now
