"""Constrained multi-turn rollouts over rollout.engine=sglang's production path on CPU: SGLang's client (one CPU
server) and SGLang's router in front of two, against the in-process engine. tool_choice=required sends SGLang's
structural tag and stop_after_call its `stop`; the servers enforce both as SGLang does (cpu/model.py,
rollout/grammar.py, rollout/stops.py).

Greedy: the same trajectories, token for token, with the same context masks and log-probs (1e-5), as the
in-process engine. Sampled: the two engines draw from different random streams (transformers' global generator
seeded per call vs one seeded generator per request, as SGLang's sampling_seed), so their tokens differ; what
holds, and is asserted, is that every first turn is the call the grammar writes, the tokens the grammar
restricted are context, and every sampled token's log-prob is the unmasked model's (a transformers forward,
what the trainer recomputes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from mgrpo.agent.parse import ToolCallParser
from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.tools import ToolSet
from mgrpo.config.multi_turn import MultiTurnConfig
from mgrpo.config.schema import ModelConfig
from mgrpo.data.printable import VOCAB, printable_tokenizer
from mgrpo.models.hf_io import init_hf_checkpoint
from mgrpo.rollout.sglang.protocol import wheel
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers.sglang_cpu import Reference, launch, post

PEEK_YAML = "configs/tools/peek.yaml"
PEEK = yaml.safe_load(open(PEEK_YAML))["tools"][0]["tool_schema"]
CFG = MultiTurnConfig(enable=True, tool_config_path=PEEK_YAML, max_assistant_turns=3, max_tokens_per_turn=64,
                      tool_choice="required", stop_after_call=True)
CALL = '<tool_call>\n{"name":"peek", "arguments":{}}\n</tool_call>'
QUESTIONS = ["Hidden digit?", "What is the digit?", "Peek, then answer.", "Which digit is it?"]


@pytest.fixture(scope="module")
def tok():
    return printable_tokenizer()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tok):
    m = dataclasses.replace(ModelConfig(), tokenizer="printable", vocab_size=len(VOCAB), max_position_embeddings=512)
    return init_hf_checkpoint(str(tmp_path_factory.mktemp("ckpt")), m, seed=3, tokenizer=tok)  # with its tokenizer


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    a = launch(ckpt, str(logs / "a"))
    try:
        b = launch(ckpt, str(logs / "b"))
    except BaseException:
        a.shutdown()
        raise
    yield a, b
    a.shutdown()
    b.shutdown()


def _records(tok, tools):
    out = []
    for i, q in enumerate(QUESTIONS):
        messages = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(messages, tools=tools.schemas(["peek"]), tokenize=False,
                                       add_generation_prompt=True)
        extra = {"tools_kwargs": {"peek": {"create_kwargs": {"secret": (3 * i + 1) % 10}}}}
        out.append((tok(text, add_special_tokens=False)["input_ids"], extra, f"record {i}", messages))
    return out


def _generate(engine):
    """The runner's generate over one engine (what the rollout group does per call)."""
    def generate(prompts, params, sessions=None, seeds=None):
        sessions = sessions or [None] * len(prompts)
        seeds = seeds or [None] * len(prompts)  # a turn's own seed (seeds.turn_seed), as the rollout group sends it
        reqs = [GenerateRequest(uid=i, prompt_ids=list(p), session=s, seed=k)
                for i, (p, s, k) in enumerate(zip(prompts, sessions, seeds))]
        return engine.generate(reqs, params), {}
    return generate


def _run(tok, engine, sampling):
    tools = ToolSet.from_config([], PEEK_YAML)
    runner = AgentRunner(CFG, tok, tools, max_response_length=320)
    return runner.run(_records(tok, tools), sampling, _generate(engine))


def _first_call(tok, t) -> list:
    turn = t.turns[0]
    got = ToolCallParser("qwen25", [PEEK]).parse(tok.decode(t.response_ids[turn.start:turn.end]))
    return [(c.name, c.arguments) for c in got.calls]


@pytest.mark.integration
def test_required_tool_calls_over_sglang_match_the_in_process_engine(tok, ckpt, servers, tmp_path):
    pytest.importorskip("sglang_router")
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from mgrpo.rollout.sglang.router import RoutedClient

    greedy = SamplingParams(temperature=0.0, max_new_tokens=64)
    local = HFRolloutEngine(ckpt, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                            tokenizer="printable")
    want, want_m = _run(tok, local, greedy)
    one, one_m = _run(tok, servers[0], greedy)
    front = RoutedClient([s.url for s in servers], host="127.0.0.1", log_dir=str(tmp_path / "router"),
                         policy="manual")
    try:
        routed, routed_m = _run(tok, front, greedy)
        sampled, _ = _run(tok, front, SamplingParams(temperature=1.0, max_new_tokens=64, seed=11))
    finally:
        front.shutdown()
    assert want_m["multi_turn/constrained_tokens"] > 4 * 20  # every first call is the grammar's
    for got, metrics in ((one, one_m), (routed, routed_m)):
        assert metrics["multi_turn/constrained_tokens"] == want_m["multi_turn/constrained_tokens"]
        for w, g in zip(want, got):
            assert g.response_ids == w.response_ids and g.sampled == w.sampled, (w.turns, g.turns)
            assert (g.finish_reason, g.counts.get("multi_turn/tool_calls")) == \
                   (w.finish_reason, w.counts.get("multi_turn/tool_calls"))
            assert [(u.role, u.start, u.end) for u in g.turns] == [(u.role, u.start, u.end) for u in w.turns]
            assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
            assert _first_call(tok, g) == [("peek", {})]
    # sampled through the router: the grammar's call first, its tokens context, the free ones the model's
    ref = Reference(ckpt)
    free = 0
    for t in sampled:
        first = tok.decode(t.response_ids[t.turns[0].start:t.turns[0].end])
        assert first.startswith(CALL) or CALL.startswith(first), first  # (a call the budget cut is a prefix)
        assert t.sampled[0] == 0, t.turns
        lp = ref.logprobs(t.prompt_ids, t.response_ids, 1.0).gather(-1, torch.tensor(t.response_ids)[:, None])[:, 0]
        for k, s in enumerate(t.sampled):
            if s:
                free += 1
                assert abs(lp[k].item() - t.logprobs[k]) <= 1e-5, (k, t.turns)
            else:
                assert t.logprobs[k] == 0.0
    assert free > 0


@pytest.mark.integration
def test_generate_with_sglangs_request_classes(tok, ckpt, servers):
    """/generate built with SGLang's own request classes (sglang/api/v1/api_types.py: GenerateRequest and
    SamplingParams, the wire form of io_struct.GenerateReqInput) and its answer read with GenerateResponse:
    the structural tag holds, `stop` ends the turn with {"type": "stop", "matched": "</tool_call>"}, the
    tokens the grammar forced have log-prob 0 (SGLang returns them over the masked logits); bad requests get
    SGLang's status and message."""
    api = wheel.contract()
    if api is None:
        pytest.skip("the sglang wheel is not installed")
    url = servers[0].url
    tag = ToolCallParser("qwen25", [PEEK]).constraint("required")[1]
    prompt = tok("<|im_start|>user\nHidden digit?<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]

    def body(**sp):
        sp = {"temperature": 1.0, "max_new_tokens": 60, "sampling_seed": 5, "no_stop_trim": True, **sp}
        return api.GenerateRequest(input_ids=prompt, return_logprob=True,
                                   sampling_params=api.SamplingParams(**sp)).to_json_value()

    r = post(url, "/generate", body(structural_tag=tag, stop=["</tool_call>"]))
    assert r.status_code == 200, r.text
    answer = api.GenerateResponse.from_json_value(r.json())
    ids = answer.output_ids
    text = tok.decode(ids)
    call_end = ids[-1] == VOCAB["</tool_call>"]
    assert text.startswith('<tool_call>\n{"name":"peek", "arguments":{}}\n'), text
    finish = r.json()["meta_info"]["finish_reason"]
    assert finish == ({"type": "stop", "matched": "</tool_call>"} if call_end else {"type": "length", "length": 60})
    forced = [lp for lp, _, _ in r.json()["meta_info"]["output_token_logprobs"]][1:30]  # after the trigger
    assert max(abs(v) for v in forced) < 1e-6, forced  # one token allowed: log 1 over the masked logits
    # a stop string alone, no grammar: the first occurrence in the text ends it, its tokens kept
    r = post(url, "/generate", body(stop=["a", "b", "c"], max_new_tokens=200))
    assert r.status_code == 200, r.text
    ids, finish = r.json()["output_ids"], r.json()["meta_info"]["finish_reason"]
    text = tok.decode(ids)
    if finish["type"] == "stop" and isinstance(finish["matched"], str):
        # SGLang looks in the decoded tail (the stop's tokens + 1): the last token holds it (it may be a whole
        # word such as </tool_call>), the text before that token holds none of them
        assert finish["matched"] in tok.decode(ids[-2:]) and not any(s in tok.decode(ids[:-1]) for s in "abc"), \
            (text, finish)
    else:
        assert not any(s in text for s in "abc"), (text, finish)
    refusals = [({"structural_tag": "{not json"}, "Failed to compile structural_tag grammar: "),
                ({"structural_tag": tag, "regex": "a+"}, "Only one of json_schema, regex, ebnf, or structural_tag"),
                ({"stop": ["x"] * 33}, "at most 32 stop strings are allowed, got 33"),
                ({"json_schema": '{"type": "object", "if": {}}'}, "Failed to compile json grammar: ")]
    for sp, message in refusals:
        r = post(url, "/generate", body(**sp))
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (sp, r.text)
    assert servers[0].health().ok  # refusals leave it serving
