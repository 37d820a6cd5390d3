"""Constrained tool calls (rollout.multi_turn.tool_choice, stop_after_call): the constraint the runner sends is
SGLang's own, the engines enforce it as SGLang's xgrammar backend does, and the tokens the grammar chose are
context (mask 0, log-prob 0.0) while the policy's free choices keep their log-probs."""

from __future__ import annotations

import json

import pytest
import yaml

from mgrpo.agent.parse import ToolCallParser
from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.tools import ToolSet
from mgrpo.config.multi_turn import MultiTurnConfig
from mgrpo.data.printable import VOCAB, printable_tokenizer
from mgrpo.heap import trim_heap
from mgrpo.rollout.grammar import GrammarError, Grammars, restricted_steps
from mgrpo.rollout.types import GenerateRequest, GenerateResult, SamplingParams
from tests.helpers.agent import ScriptedPolicy

trim_heap()  # the engine trims every 16 decode steps; finding libc runs ldconfig once: here, not inside a test
PEEK = yaml.safe_load(open("configs/tools/peek.yaml"))["tools"][0]["tool_schema"]
# SGLang 0.5.23's legacy structural tag for a strict qwen25 tool (function_call_parser.py
# get_legacy_structural_tag with Qwen25Detector.structure_info), written out
EXPECTED = {"type": "structural_tag",
            "structures": [{"begin": '<tool_call>\n{"name":"peek", "arguments":',
                            "schema": {"type": "object", "properties": {}, "const": {}}, "end": "}\n</tool_call>"}],
            "triggers": ["<tool_call>"], "at_least_one": False}


@pytest.fixture(scope="module")
def tok():
    return printable_tokenizer()


def test_the_constraint_is_sglangs_structural_tag():
    p = ToolCallParser("qwen25", [PEEK])
    kind, value = p.constraint("auto")
    assert kind == "structural_tag" and json.loads(value) == EXPECTED
    assert json.loads(p.constraint("required")[1]) == {**EXPECTED, "at_least_one": True}
    loose = {**PEEK, "function": {k: v for k, v in PEEK["function"].items() if k != "strict"}}
    assert ToolCallParser("qwen25", [loose]).constraint("auto") is None  # SGLang: auto constrains strict tools
    assert json.loads(ToolCallParser("qwen25", [loose]).constraint("required")[1])["structures"][0]["schema"] == {}
    assert p.end_of_call() == "</tool_call>"


def test_a_malformed_structural_tag_is_refused_as_sglang_refuses_it(tok):
    g = Grammars(tok, len(VOCAB), [tok.eos_token_id])
    bad_schema = {"structures": [{"begin": "<a>", "schema": {"type": "nope"}, "end": "</a>"}], "triggers": ["<a>"]}
    with pytest.raises(GrammarError, match=r'^Failed to compile structural_tag grammar: .*Unsupported type "nope"'):
        g.compile_structural_tag(json.dumps(bad_schema))
    with pytest.raises(GrammarError, match=r"^Failed to compile structural_tag grammar: Expecting property name"):
        g.compile_structural_tag("{not json")
    with pytest.raises(GrammarError, match=r"needs 'triggers'"):
        g.compile_structural_tag(json.dumps({"structures": []}))


def test_a_random_model_under_required_writes_a_call_the_parser_accepts(tok, tmp_path):
    """The in-process engine enforces the tag: every row of a random model is one well-formed call (tokens
    the grammar restricted, per the replay, include every token of the call after its trigger)."""
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from tests.helpers.convert import make_hf_checkpoint, tiny_cfg

    hf_dir = make_hf_checkpoint(str(tmp_path), tiny_cfg(vocab_size=len(VOCAB), max_position_embeddings=256))
    engine = HFRolloutEngine(hf_dir, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                             tokenizer="printable")
    parser = ToolCallParser("qwen25", [PEEK])
    tag = parser.constraint("required")[1]
    prompt = tok("<|im_start|>user\nHidden digit?<|im_end|>\n<|im_start|>assistant\n",
                 add_special_tokens=False)["input_ids"]
    out = engine.generate([GenerateRequest(uid=i, prompt_ids=prompt) for i in range(4)],
                          SamplingParams(temperature=1.0, max_new_tokens=60, seed=4, structural_tag=tag,
                                         stop=("</tool_call>",)))
    g = Grammars(tok, len(VOCAB), [tok.eos_token_id])
    call = '<tool_call>\n{"name":"peek", "arguments":{}}\n</tool_call>'
    ends = []
    for r in out:
        text = tok.decode(r.token_ids, skip_special_tokens=False)
        assert text.startswith(call), text
        # the grammar's end `</tool_call>` is one token or its 12 characters; SGLang matches a stop string in
        # the last (its length in tokens + 1) tokens, so only the token ends the turn (rollout/stops.py)
        n = next(k for k in range(len(r.token_ids) + 1) if tok.decode(r.token_ids[:k]) == call)
        by_token = r.token_ids[n - 1] == VOCAB["</tool_call>"]
        ends.append(by_token)
        assert (r.finish_reason, len(r.token_ids)) == (("stop", n) if by_token else ("length", 60)), text
        got = parser.parse(tok.decode(r.token_ids[:n]))
        assert [(c.name, c.arguments) for c in got.calls] == [("peek", {})] and got.malformed == 0, text
        flags = restricted_steps(g.compile_structural_tag(tag), r.token_ids, len(VOCAB))
        assert all(flags[:n]), (text, flags)  # 'required': nothing in the call is the policy's free choice
    assert sorted(ends) == [False, True, True, True]  # seed 4: one row spelled the end in characters
    # the bad tag is refused before anything is generated
    with pytest.raises(GrammarError):
        engine.generate([GenerateRequest(uid=0, prompt_ids=prompt)],
                        SamplingParams(max_new_tokens=4, structural_tag="{not json"))


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_structural_tag_and_its_ebnf_are_one_grammar(tok, choice):
    """What the client sends through sglang-router (which drops structural_tag) is the same grammar: 100
    random walks (each step a token the grammar allows) see the same allowed set at every step, and end
    together."""
    import random

    import torch
    import xgrammar as xgr

    from mgrpo.rollout.grammar import structural_tag_ebnf

    g = Grammars(tok, len(VOCAB), [tok.eos_token_id])
    key = ToolCallParser("qwen25", [PEEK]).constraint(choice)[1]
    a, b = g.compile("structural_tag", key), g.compile("ebnf", structural_tag_ebnf(key))
    rng, steps = random.Random(0), 0
    masks = xgr.allocate_token_bitmask(2, len(VOCAB))
    for _ in range(100):
        ma, mb = xgr.GrammarMatcher(a), xgr.GrammarMatcher(b)
        while not ma.is_terminated() and steps < 20000:
            ma.fill_next_token_bitmask(masks, 0)
            mb.fill_next_token_bitmask(masks, 1)
            assert torch.equal(masks[0], masks[1]), steps
            probe = torch.zeros(1, len(VOCAB))
            xgr.apply_token_bitmask_inplace(probe, masks[:1], vocab_size=len(VOCAB))
            t = rng.choice(torch.isfinite(probe[0]).nonzero()[:, 0].tolist())
            assert ma.accept_token(t) and mb.accept_token(t)
            steps += 1
        assert mb.is_terminated() == ma.is_terminated()
    assert steps > 2000


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tokens_the_grammar_chose_are_context(tok, choice):
    """stop_after_call: free text and the trigger are sampled (mask 1, their log-probs kept) where the
    grammar left them free (auto); the call the grammar wrote is context; the turn's end-of-turn token, never
    sampled, is inserted as context before the tool's reply; the request carried the tag and the stop text.
    After the call, tool_choice is auto again (reset_tool_choice)."""
    tools = ToolSet.from_config([], "configs/tools/peek.yaml")
    cfg = MultiTurnConfig(enable=True, tool_config_path="configs/tools/peek.yaml", max_assistant_turns=2,
                          stop_after_call=True, tool_choice=choice)
    runner = AgentRunner(cfg, tok, tools, max_response_length=512)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hidden digit?"}], tools=tools.schemas(["peek"]),
                                     tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    turns = [('ab' if choice == "auto" else "") + '<tool_call>\n{"name":"peek", "arguments":{}}\n</tool_call>', "7"]
    seen = []

    def generate(prompts, sampling, sessions=None):
        seen.append(sampling)
        ids = tok(turns[len(seen) - 1], add_special_tokens=False)["input_ids"]
        if len(seen) == 2:
            ids = ids + [tok.eos_token_id]
        return [GenerateResult(uid=0, token_ids=ids, logprobs=[-1.5] * len(ids), finish_reason="stop",
                               weight_version=0)], {}

    (t,), metrics = runner.run([(prompt_ids, {"tools_kwargs": {"peek": {"create_kwargs": {"secret": 7}}}}, "")],
                               SamplingParams(max_new_tokens=100), generate)
    assert t.finish_reason == "stop" and t.counts["multi_turn/tool_calls"] == 1
    assert json.loads(seen[0].structural_tag) == {**EXPECTED, "at_least_one": choice == "required"}
    assert json.loads(seen[1].structural_tag) == EXPECTED
    assert seen[0].stop == ("</tool_call>",)
    first = tok(turns[0], add_special_tokens=False)["input_ids"]
    # auto: a, b and <tool_call> were free; the grammar wrote the rest (</tool_call> was one of 2 choices:
    # the token or '<'); required: the grammar wrote the whole call
    free = 3 if choice == "auto" else 0
    assert t.sampled[:len(first)] == [1] * free + [0] * (len(first) - free)
    assert t.logprobs[:len(first)] == [-1.5] * free + [0.0] * (len(first) - free)
    reply = t.turns[1]
    assert t.response_ids[reply.start] == tok.eos_token_id and not any(t.sampled[reply.start:reply.end])
    assert tok.decode(t.response_ids[reply.start:reply.end]).startswith("<|im_end|>\n<|im_start|>user\n"
                                                                         "<tool_response>\n" + "7" * 96 + "\n</tool_response>")  # peek.yaml: repeat 96
    assert t.sampled[t.turns[2].start:] == [1, 1] and metrics["multi_turn/constrained_tokens"] == len(first) - free


def test_the_peek_judge_reads_the_first_digit_of_the_last_assistant_turn():
    from mgrpo.rewards.synthetic import peek_score

    def turns(*texts):
        return {"turns": {"turns": [{"role": r, "text": t} for r, t in texts]}}

    call = '<tool_call>\n{"name":"peek", "arguments":{}}\n</tool_call>'
    assert peek_score("mgrpo/peek", "", "7", turns(("assistant", call), ("tool", "7"), ("assistant", "ab7c3"))) == 1.0
    assert peek_score("mgrpo/peek", "", "7", turns(("assistant", call), ("tool", "7"), ("assistant", "3 7"))) == 0.0
    assert peek_score("mgrpo/peek", "", "7", turns(("assistant", "<think>7</think>x"),)) == 0.0  # thinking is not the answer
    assert peek_score("mgrpo/peek", "", "7", turns(("assistant", "7<|im_end|>"),)) == 1.0  # a guess counts as a guess
    assert peek_score("mgrpo/peek", "", "7", turns(("assistant", call),)) == 0.0  # no answer: 0, no credit
    with pytest.raises(ValueError, match="multi-turn"):
        peek_score("mgrpo/peek", "7", "7", {})


def test_tool_choice_is_validated():
    from mgrpo.config.checks import multi_turn_errors

    errors = multi_turn_errors(MultiTurnConfig(enable=True, tool_choice="sometimes", function_tools=["x:y"]),
                               "printable")
    assert errors == ["rollout.multi_turn.tool_choice='sometimes': auto | required"]


def test_the_sglang_payload_carries_the_constraint():
    """What goes to an SGLang server: structural_tag and stop in sampling_params, through SGLang's own JSON
    contract (the wheel's decoder is strict about field names and types)."""
    from mgrpo.rollout.sglang.client import build_generate_payload
    from mgrpo.rollout.sglang.protocol import wheel

    tag = ToolCallParser("qwen25", [PEEK]).constraint("auto")[1]
    body = build_generate_payload([GenerateRequest(uid=0, prompt_ids=[1, 2, 3])],
                                  SamplingParams(max_new_tokens=8, structural_tag=tag, stop=("</tool_call>",)),
                                  rids=["a"], send_seed=False)
    assert body["sampling_params"]["structural_tag"] == tag and body["sampling_params"]["stop"] == ["</tool_call>"]
    contract = wheel.contract()
    if contract is None:
        pytest.skip("sglang wheel or msgspec not installed (pip install --no-deps -r requirements-sglang.txt)")
    contract.GenerateRequest.from_json_value(body)


def test_a_call_ended_in_characters_ends_the_turn_in_the_runner(tok):
    """stop_after_call: the engines match `stop` as SGLang does (in the last few tokens), which misses a
    `</tool_call>` the grammar spelled character by character; the runner ends the turn there itself: the
    tokens past it are dropped and counted, the call runs, its end-of-turn token is context."""
    tools = ToolSet.from_config([], "configs/tools/peek.yaml")
    cfg = MultiTurnConfig(enable=True, tool_config_path="configs/tools/peek.yaml", max_assistant_turns=2,
                          stop_after_call=True, tool_choice="required")
    runner = AgentRunner(cfg, tok, tools, max_response_length=512)
    prompt_ids = tok(tok.apply_chat_template([{"role": "user", "content": "Hidden digit?"}],
                                             tools=tools.schemas(["peek"]), tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)["input_ids"]
    call = tok('<tool_call>\n{"name":"peek", "arguments":{}}\n', add_special_tokens=False)["input_ids"]
    spelled = call + [VOCAB[c] for c in "</tool_call>"]
    turns = [spelled + tok("junk", add_special_tokens=False)["input_ids"], tok("7", add_special_tokens=False)["input_ids"]
             + [tok.eos_token_id]]

    def generate(prompts, sampling, sessions=None):
        ids = turns.pop(0)
        return [GenerateResult(uid=0, token_ids=ids, logprobs=[-1.0] * len(ids), finish_reason="length" if turns
                               else "stop", weight_version=0)], {}

    (t,), metrics = runner.run([(prompt_ids, {"tools_kwargs": {"peek": {"create_kwargs": {"secret": 7}}}}, "")],
                               SamplingParams(max_new_tokens=100), generate)
    assert t.finish_reason == "stop" and t.counts["multi_turn/tool_calls"] == 1
    assert t.response_ids[:len(spelled)] == spelled and t.response_ids[len(spelled)] == tok.eos_token_id
    assert metrics["multi_turn/tokens_cut_after_call"] == 4 and t.turns[0].end == len(spelled)


def test_required_per_group_forces_the_first_k_samples_of_each_group(tok):
    """rollout.multi_turn.required_per_group=2 with groups of 4 (rollout.n): the first turn of samples 0-1 of
    each group carries SGLang's constraint for tool_choice=required (at_least_one), that of samples 2-3 the one
    for auto; every turn after a call is auto. The free samples' calls are theirs: multi_turn/free_call_rate
    counts those alone (here 2 of the 4 free samples call). Without a group size (a validation) none is forced."""
    tools = ToolSet.from_config([], "configs/tools/peek.yaml")
    cfg = MultiTurnConfig(enable=True, tool_config_path="configs/tools/peek.yaml", max_assistant_turns=2,
                          stop_after_call=True, tool_choice="auto", required_per_group=2)
    runner = AgentRunner(cfg, tok, tools, max_response_length=512)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"Hidden digit {i}?"}],
                                           tools=tools.schemas(["peek"]), tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for i in range(8)]  # 2 groups of 4 (distinct: uid_of)
    call = '<tool_call>\n{"name":"peek", "arguments":{}}\n</tool_call>'
    calls_freely = {2, 7}  # free samples (index 2-3 of a group) that call; 3 and 6 answer at once

    def script(uid: int, turn: int) -> str:
        if turn == 0 and (uid % 4 < 2 or uid in calls_freely):
            return call  # what the grammar writes under required; a free sample's own call under auto
        return "7"

    policy = ScriptedPolicy(tok, script, prompts)
    tags: dict[tuple[int, int], dict] = {}

    def generate(batch, sampling, sessions=None):
        for ids in batch:
            uid = policy.uid_of(ids)
            tags[(uid, len(policy.sampled.get(uid, [])))] = json.loads(sampling.structural_tag)
        return policy(batch, sampling)

    extra = {"tools_kwargs": {"peek": {"create_kwargs": {"secret": 7}}}}
    trajs, m = runner.run([(p, extra, "") for p in prompts], SamplingParams(max_new_tokens=100), generate,
                          group_size=4)
    assert [tags[(u, 0)]["at_least_one"] for u in range(8)] == [True, True, False, False] * 2
    assert all(not tag["at_least_one"] for (u, turn), tag in tags.items() if turn > 0)
    assert sorted(u for (u, turn) in tags if turn == 1) == [0, 1, 2, 4, 5, 7]  # every caller answered after
    assert [t.forced for t in trajs] == [True, True, False, False] * 2
    assert [t.called for t in trajs] == [True, True, True, False, True, True, False, True]
    assert [t.to_json()["forced"] for t in trajs] == [t.forced for t in trajs]
    assert (m["multi_turn/forced_trajectories"], m["multi_turn/free_trajectories"],
            m["multi_turn/free_calling_trajectories"], m["multi_turn/free_call_rate"]) == (4, 4, 2, 0.5)
    assert m["multi_turn/tool_calls_per_trajectory"] == 6 / 8
    # the forced calls were the grammar's (context), the free ones' trigger was sampled
    assert all(t.sampled[0] == 0 for t in trajs[:2]) and trajs[2].sampled[0] == 1

    tags.clear()
    policy = ScriptedPolicy(tok, script, prompts)
    trajs, m = runner.run([(p, extra, "") for p in prompts], SamplingParams(max_new_tokens=100), generate)
    assert not any(t.forced for t in trajs) and not any(tags[(u, 0)]["at_least_one"] for u in range(8))
    assert m["multi_turn/forced_trajectories"] == 0 and m["multi_turn/free_trajectories"] == 8


@pytest.mark.parametrize("change, message", [
    ({"required_per_group": 9}, "rollout.multi_turn.required_per_group=9 must be in [0, rollout.n=8]"),
    ({"required_per_group": -1}, "rollout.multi_turn.required_per_group=-1 must be in [0, rollout.n=8]"),
    ({"required_per_group": 4, "tool_choice": "required"},
     "rollout.multi_turn.required_per_group=4 forces the call of some samples and leaves the others to "
     "rollout.multi_turn.tool_choice, which must then be auto (is 'required')"),
    ({"required_per_group": 4, "reset_tool_choice": False},
     "rollout.multi_turn.required_per_group=4 needs rollout.multi_turn.reset_tool_choice=true"),
    ({"required_per_group": 4, "tool_config_path": None, "environment": "tests.helpers.agent:AlwaysReply"},
     "rollout.multi_turn.required_per_group=4 needs tools to call"),
])
def test_required_per_group_is_validated(change, message):
    """The validator refuses a bad rollout.multi_turn.required_per_group, naming the key."""
    import dataclasses

    from mgrpo.config import MGRPOConfig
    from mgrpo.config.validate import field_errors

    cfg = MGRPOConfig()
    mt = dataclasses.replace(cfg.rollout.multi_turn, enable=True, tool_config_path="configs/tools/peek.yaml",
                             tool_choice="auto")
    ok = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tokenizer="printable"),
                             rollout=dataclasses.replace(cfg.rollout, n=8, multi_turn=dataclasses.replace(
                                 mt, required_per_group=8)))
    assert not [e for e in field_errors(ok) if "multi_turn" in e]
    bad = dataclasses.replace(ok, rollout=dataclasses.replace(ok.rollout, multi_turn=dataclasses.replace(
        mt, **change)))
    errors = [e for e in field_errors(bad) if "multi_turn" in e]
    assert len(errors) == 1 and errors[0].startswith(message), errors
