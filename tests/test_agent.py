"""Multi-turn agentic rollouts (mgrpo/agent/): tool schemas, veRL tool configs, SGLang's tool-call parser,
token-in token-out trajectories on the real Qwen3 tokenizer and chat template, bounds and finish reasons,
per-trajectory concurrency, and the loss mask through the trainer's batch path."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
import torch

from mgrpo.agent.parse import ToolCallParser
from mgrpo.agent.calls import truncate
from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.tools import FunctionTool, ToolSet, function_schema, load_verl_tool_config
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.rollout.types import GenerateResult, SamplingParams
from tests.helpers.agent import ScriptedPolicy


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    from mgrpo.data.tokenizer import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    return f"value-of-{key}" * 40  # long: truncated by max_tool_response_length


def boom(x: int) -> str:
    """Always raises."""
    raise RuntimeError("kaput")


def _prompts(tok, tools: ToolSet, k: int) -> list[list[int]]:
    schemas = tools.schemas(list(tools.tools))
    return [tok(tok.apply_chat_template([{"role": "user", "content": f"question {i}"}], tools=schemas, tokenize=False,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for i in range(k)]


def _call(name: str, args: dict, compact: bool = False) -> str:
    body = json.dumps({"name": name, "arguments": args}, separators=(",", ":") if compact else None,
                      ensure_ascii=False)  # as the template's tojson
    return f"<tool_call>\n{body}\n</tool_call>"


# --- tools -----------------------------------------------------------------------------------------------
def test_function_schema_from_type_hints_and_docstring():
    assert function_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first"},
                                                        "b": {"type": "integer", "description": "the second"}},
                       "required": ["a"]}}}


def test_verl_tool_config_yaml_runs_the_lifecycle(tmp_path):
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: mgrpo.agent.examples.PeekTool\n    config: {type: native}\n"
                    "    tool_schema:\n      type: function\n      function: {name: peek, description: d, "
                    "parameters: {type: object, properties: {}}}\n")
    (tool,) = load_verl_tool_config(str(path))

    async def lifecycle():
        iid = await tool.create(secret=7)
        out = await tool.execute(iid, {})
        await tool.release(iid)
        return out, tool.secrets

    (text, reward, metrics), left = asyncio.run(lifecycle())
    assert (text, reward, metrics, left) == ("7", None, {}, {})
    bad = tmp_path / "bad.yaml"
    bad.write_text("tools:\n  - config: {}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: tools\[0\]: field 'class_name' missing"):
        load_verl_tool_config(str(bad))


def test_sglang_parser_counts_what_it_drops():
    p = ToolCallParser("qwen25", [function_schema(add)])
    text = ("<think>\nhm\n</think>\n\nok\n" + _call("add", {"a": 1}) + "\n" + _call("sub", {"a": 1})
            + "\n<tool_call>\n{broken\n</tool_call>")
    got = p.parse(text)
    assert got.content == "<think>\nhm\n</think>\n\nok"
    assert [(c.name, c.arguments, c.known) for c in got.calls] == [("add", {"a": 1}, True), ("sub", {"a": 1}, False)]
    assert got.malformed == 1
    assert p.parse("no call here").calls == [] and p.parse("no call here").malformed == 0


def test_truncation_matches_verl():
    assert truncate("abcdefgh", 4, "left") == ("abcd...(truncated)", True)
    assert truncate("abcdefgh", 4, "right") == ("(truncated)...efgh", True)
    assert truncate("abcdefgh", 4, "middle") == ("ab...(truncated)...gh", True)
    assert truncate("abc", 4, "middle") == ("abc", False)


# --- token-in token-out on the real Qwen3 template --------------------------------------------------------
def _random_conversation(rng: random.Random, uid: int, turns: int):
    """script(turn) -> the text the 'model' samples: think blocks, content, 1-3 parallel calls (add or the
    long lookup), the last turn an answer."""
    def script(_uid, turn):
        think = f"<think>\nstep {turn} of {uid}: {rng.choice(['hmm', 'so', 'wait, 3+4'])}\n</think>\n\n"
        if turn + 1 >= turns:
            return think + f"The answer is {rng.randint(0, 99)}."
        calls = [_call("add", {"a": rng.randint(0, 9), "b": rng.randint(0, 9)}) if rng.random() < 0.6
                 else _call("lookup", {"key": rng.choice(["x", "y z", "ünï"])}) for _ in range(rng.randint(1, 3))]
        content = rng.choice(["", "Let me check."])
        return think + (content + "\n" if content else "") + "\n".join(calls)
    return script


def test_trajectories_are_token_exact_against_the_qwen3_template(qwen3):
    """40 random conversations built token by token: every sampled token is where it was sampled (never
    re-encoded), tool replies and template tokens are context, and the tokenizer's own chat template renders
    the finished conversation to exactly the same ids (0 drift tokens), long tool replies truncated."""
    rng = random.Random(0)
    tools = ToolSet([FunctionTool(add), FunctionTool(lookup)])
    cfg = MultiTurnConfig(enable=True, max_assistant_turns=4, max_tool_response_length=50, function_tools=["x:y"])
    runner = AgentRunner(cfg, qwen3, tools, max_response_length=4096)
    k = 40
    prompts = _prompts(qwen3, tools, k)
    scripts = [_random_conversation(rng, i, rng.randint(1, 4)) for i in range(k)]
    policy = ScriptedPolicy(qwen3, lambda uid, turn: scripts[uid](uid, turn), prompts)
    trajs, metrics = runner.run([(p, {}, f"t:{i}") for i, p in enumerate(prompts)], SamplingParams(max_new_tokens=4096),
                                policy)
    schemas = tools.schemas(list(tools.tools))
    assert {t.finish_reason for t in trajs} == {"stop"}
    assert metrics["multi_turn/tool_response_truncated"] > 0 and metrics["multi_turn/tool_calls"] > k
    for t in trajs:
        sampled = [x for x, m in zip(t.response_ids, t.sampled) if m]
        assert sampled == [x for s in policy.sampled[t.uid] for x in s]  # the engine's ids, in order, untouched
        assert [lp for lp, m in zip(t.logprobs, t.sampled) if not m] == [0.0] * (len(t.sampled) - sum(t.sampled))
        for turn in t.turns:  # context turns are the template's rendering of the replies
            if turn.role == "tool":
                text = qwen3.decode(t.response_ids[turn.start:turn.end])
                assert text.startswith("\n<|im_start|>user\n<tool_response>\n") and text.endswith(
                    "</tool_response><|im_end|>\n<|im_start|>assistant\n"), text
        msgs = [{"role": "user", "content": f"question {t.uid}"}]
        assert runner.drift(t, msgs, schemas) == 0
        whole = qwen3.apply_chat_template(msgs + t.messages, tools=schemas, tokenize=False)
        assert qwen3.decode(t.prompt_ids + t.response_ids) + "\n" == whole


def test_drift_is_counted_where_the_model_writes_json_its_own_way(qwen3):
    """A model that writes compact JSON ({"a":1}) is trained on what it wrote; the template would re-serialise
    it with spaces. The drift check finds exactly those tokens, and only those."""
    tools = ToolSet([FunctionTool(add)])
    runner = AgentRunner(MultiTurnConfig(enable=True, function_tools=["x:y"]), qwen3, tools, max_response_length=512)
    prompts = _prompts(qwen3, tools, 2)
    script = lambda uid, turn: ("<think>\nx\n</think>\n\n" + (_call("add", {"a": 1, "b": 2}, compact=uid == 1)  # noqa: E731
                                                            if turn == 0 else "3"))
    trajs, _ = runner.run([(p, {}, "") for p in prompts], SamplingParams(max_new_tokens=512),
                          ScriptedPolicy(qwen3, script, prompts))
    schemas = tools.schemas(["add"])
    drift = [runner.drift(t, [{"role": "user", "content": f"question {t.uid}"}], schemas) for t in trajs]
    compact = qwen3(json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}}, separators=(",", ":")),
                    add_special_tokens=False)["input_ids"]
    spaced = qwen3(json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}}), add_special_tokens=False)["input_ids"]
    from mgrpo.agent.template import count_drift

    assert drift[0] == 0 and drift[1] == count_drift(compact, spaced) > 0


# --- bounds, failures, finish reasons ---------------------------------------------------------------------
def _run(tok, tools, script, cfg, *, k=1, max_response_length=1024, delay_s=0.0):
    runner = AgentRunner(cfg, tok, tools, max_response_length=max_response_length)
    prompts = _prompts(tok, tools, k)
    policy = ScriptedPolicy(tok, script, prompts, delay_s=delay_s)
    t0 = time.monotonic()
    trajs, metrics = runner.run([(p, {}, "") for p in prompts], SamplingParams(max_new_tokens=10_000), policy)
    return trajs, metrics, time.monotonic() - t0, policy


def test_bounds_end_trajectories_with_their_finish_reasons(qwen3):
    tools = ToolSet([FunctionTool(add), FunctionTool(boom)])
    always_call = lambda uid, turn: _call("add", {"a": turn})  # noqa: E731
    trajs, m, _, _ = _run(qwen3, tools, always_call, MultiTurnConfig(max_assistant_turns=3, function_tools=["x:y"]))
    assert trajs[0].finish_reason == "max_turns" and m["multi_turn/turns_mean"] == 3
    assert m["multi_turn/tool_calls"] == 2  # the third turn's call is not run

    # the response budget: per-turn tokens clamped to what is left; replies that do not fit end it
    trajs, m, _, _ = _run(qwen3, tools, always_call, MultiTurnConfig(max_assistant_turns=50, function_tools=["x:y"]),
                          max_response_length=100)
    assert trajs[0].finish_reason == "length" and len(trajs[0].response_ids) <= 100

    # a tool that raises, an unknown tool, bad arguments, a malformed call: errors as replies, counted per tool
    script = lambda uid, turn: ("\n".join([_call("boom", {"x": 1}), _call("nope", {}), _call("add", {"c": 1}),  # noqa: E731
                                           "<tool_call>\n{oops\n</tool_call>"]) if turn == 0 else "done")
    trajs, m, _, _ = _run(qwen3, tools, script, MultiTurnConfig(function_tools=["x:y"]))
    t = trajs[0]
    assert t.finish_reason == "stop" and not t.failed and not t.masked
    assert (m["multi_turn/tool_raised"], m["multi_turn/unknown_tool"], m["multi_turn/parse_errors"],
            m["multi_turn/bad_arguments"]) == (1, 1, 1, 1)
    assert m["multi_turn/tool_errors"] == 4 and m["multi_turn/tool_errors/boom"] == 1
    assert m["multi_turn/tool_errors/add"] == 1  # add's bad argument 'c'
    replies = qwen3.decode(t.response_ids[t.turns[1].start:t.turns[1].end])
    assert replies.count("<tool_response>\nError: ") == 4 and "boom raised RuntimeError: kaput" in replies

    # ... or, with on_tool_error=mask, the trajectory is kept out of the loss
    trajs, m, _, _ = _run(qwen3, tools, script, MultiTurnConfig(function_tools=["x:y"], on_tool_error="mask"))
    assert trajs[0].masked and m["multi_turn/masked"] == 1


def test_hanging_tools_and_slow_trajectories_are_cut_and_failed(qwen3):
    import threading

    release = threading.Event()

    def hang(x: int) -> str:
        """Hangs (a sync tool: its thread cannot be killed, only abandoned)."""
        release.wait(30)
        return "late"

    tools = ToolSet([FunctionTool(hang), FunctionTool(add)])
    script = lambda uid, turn: _call("hang" if uid == 0 else "add", {"x": 1} if uid == 0 else {"a": 1}) \
        if turn == 0 else "ok"  # noqa: E731
    try:
        trajs, m, took, _ = _run(qwen3, tools, script, MultiTurnConfig(function_tools=["x:y"], tool_timeout_s=0.5), k=2)
    finally:
        release.set()
    assert took < 10
    assert [t.finish_reason for t in trajs] == ["tool_timeout", "stop"] and trajs[0].failed
    assert m["multi_turn/tool_timeouts/hang"] == 1 and m["multi_turn/failed"] == 1

    # the wall-clock limit of a whole trajectory (slow generation)
    trajs, m, took, _ = _run(qwen3, ToolSet([FunctionTool(add)]), lambda u, t: _call("add", {"a": 1}),
                             MultiTurnConfig(function_tools=["x:y"], max_assistant_turns=50, trajectory_timeout_s=1.0),
                             delay_s=0.3)
    assert trajs[0].finish_reason == "trajectory_timeout" and trajs[0].failed and took < 10


def test_a_slow_tool_holds_only_its_own_trajectory(qwen3):
    """Trajectory 0 waits 2 s on its tool; trajectory 1 makes all its turns meanwhile."""
    async def slow(x: int) -> str:
        """Slow.

        Args:
            x: a number
        """
        await asyncio.sleep(2.0)
        return "1"

    tools = ToolSet([FunctionTool(slow), FunctionTool(add)])
    script = lambda uid, turn: (_call("slow", {"x": 1}) if uid == 0 else _call("add", {"a": turn})) \
        if turn < (1 if uid == 0 else 4) else "done"  # noqa: E731
    trajs, _, took, policy = _run(qwen3, tools, script, MultiTurnConfig(function_tools=["x:y"], max_assistant_turns=6),
                                  k=2)
    assert [t.finish_reason for t in trajs] == ["stop", "stop"]
    start = policy.calls[0][0]
    fast_done = max(t for t, uids in policy.calls if 1 in uids)
    assert fast_done - start < 1.5 < took  # trajectory 1's five turns all came before trajectory 0's tool answered


# --- the loss mask through the trainer's batch path -------------------------------------------------------
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_context_tokens_get_exactly_zero_gradient(mode):
    """A multi-turn experience through the actor client's sharding and a packed micro-batch into the policy
    loss: the gradient with respect to every context token's logits is exactly 0, every sampled token's is not,
    and token-mean divides by sampled tokens only."""
    import dataclasses

    from mgrpo.algorithms.policy_loss import TokenLossInputs, policy_loss
    from mgrpo.components.actor_client import ActorClient
    from mgrpo.config import MGRPOConfig
    from mgrpo.experience import Experience
    from mgrpo.training.batch import batch_layout, build_micro_batch

    cfg = MGRPOConfig()
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, loss_agg_mode=mode))
    g = torch.Generator().manual_seed(0)
    masks = [[1, 1, 0, 0, 0, 1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 0, 0, 0, 0, 1, 1]]
    exp = Experience(prompt_ids=[[1, 2], [3], [4, 5, 6]],
                     response_ids=[torch.randint(0, 16, (len(m),), generator=g).tolist() for m in masks],
                     rollout_logprobs=[[-1.0 if x else 0.0 for x in m] for m in masks], finish_reasons=["stop"] * 3,
                     weight_versions=[0] * 3, group_index=[0, 0, 0], in_loss=[True] * 3, sampled_mask=masks)
    exp.rewards = [1.0, 0.0, 0.5]
    exp.compute_advantages(cfg)
    exp.old_logprobs = [[-1.0] * len(m) for m in masks]
    exp.ref_logprobs = [[-1.5] * len(m) for m in masks]  # the KL term is masked too
    (shard,) = ActorClient(None, cfg, dp=1)._shards(exp, range(3), for_training=True)
    mb = build_micro_batch(shard, batch_layout(packed=True))
    logits = torch.randn(mb.num_tokens, 16, generator=g, requires_grad=True)
    lp = torch.log_softmax(logits, -1).gather(-1, mb.labels[:, None]).squeeze(-1)
    f = mb.fields
    inputs = TokenLossInputs(old_logprob=f["old_logprobs"], ref_logprob=f["ref_logprobs"], advantages=f["advantages"],
                             rollout_logprob=f["rollout_logprobs"], token_weight=f["token_weight"],
                             metric_weight=torch.full_like(f["token_weight"], mb.metric_weight),
                             seq_index=f.get("seq_index"))
    loss, metrics = policy_loss(lp, None, inputs, cfg.algorithm)
    loss.backward()
    sampled = torch.tensor([x for m in masks for x in m], dtype=torch.bool)  # packed: sample order
    per_token = logits.grad.abs().sum(-1)
    assert torch.all(per_token[~sampled] == 0)
    assert torch.all(per_token[sampled] > 0)
    if mode == "token-mean":
        assert mb.metric_weight == pytest.approx(1 / int(sampled.sum()))
        assert f["token_weight"][sampled].tolist() == pytest.approx([1 / int(sampled.sum())] * int(sampled.sum()))


# --- into the experience: failed samples stay in place, out of the loss and their group's baseline ---------
def _maker_run(qwen3, tmp_digits: list[list], *, min_group_size: int = 2, **mt):
    """Two prompts, n=3 each, through the experience maker: sample j of prompt i first calls `add` with
    a=digits[i][j] (or the hanging tool where the digit is None), then answers the tool's reply; the judge
    (flaky_digit_reward) scores an answer d as d/10. Judged; returns the experience and both metric dicts."""
    import dataclasses
    import re
    import threading
    from types import SimpleNamespace

    from mgrpo.components.experience_maker import ExperienceMaker
    from mgrpo.config import MGRPOConfig
    from mgrpo.data.dataset import PromptItem
    from mgrpo.rewards import Judger

    release = threading.Event()

    def hang(x: int) -> str:
        """Hangs."""
        release.wait(30)
        return "late"

    tools = ToolSet([FunctionTool(add), FunctionTool(hang)])
    cfg = MGRPOConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tokenizer="qwen3"),
                              data=dataclasses.replace(cfg.data, max_response_length=512),
                              rollout=dataclasses.replace(cfg.rollout, n=3, multi_turn=MultiTurnConfig(
                                  enable=True, function_tools=["x:y"], tool_timeout_s=0.5, **mt)))
    cfg.reward.custom_functions = {"s": "tests.helpers.reward_fns:flaky_digit_reward"}
    cfg.reward.num_workers = 0
    cfg.reward.failed.min_group_size = min_group_size
    prompts = _prompts(qwen3, tools, 2)
    schemas = tools.schemas(list(tools.tools))
    items = [PromptItem(index=i, prompt_ids=prompts[i], prompt_text="", data_source="s", ground_truth="3",
                        messages=[{"role": "user", "content": f"question {i}"}], tools=schemas) for i in range(2)]
    seen = {0: 0, 1: 0}

    def generate(prompts_, n, params, desc, sessions=None):  # the rollout group's signature; n is 1 per turn
        out = []
        for ids in prompts_:
            if ids in prompts:  # a first turn
                i = prompts.index(ids)
                d = tmp_digits[i][seen[i]]
                seen[i] += 1
                text = _call("hang", {"x": 1}) if d is None else _call("add", {"a": d, "b": 0})
            else:  # answer with the tool's reply
                text = re.findall(r"<tool_response>\n(\d+)", qwen3.decode(ids))[-1]
            new = qwen3(text, add_special_tokens=False)["input_ids"] + [qwen3.eos_token_id]
            out.append(GenerateResult(uid=0, token_ids=new, logprobs=[-0.5] * len(new), finish_reason="stop",
                                      weight_version=0))
        return out, SimpleNamespace(retries=0, restarts=0, auth_refused=0)

    maker = ExperienceMaker(cfg, tokenizer=qwen3, train_data=None, rollout=SimpleNamespace(generate=generate),
                            tools=tools, judger=None)
    try:
        exp, measured = maker.generate(items, 3, SamplingParams(max_new_tokens=256))
    finally:
        release.set()
    with Judger(cfg.reward) as judger:
        judged = exp.judge(judger, qwen3, cfg)
    exp.compute_advantages(cfg)
    return exp, measured, judged


def _grpo(scores: list[float]) -> list[float]:
    import statistics

    mean, std = statistics.fmean(scores), statistics.stdev(scores)
    return [(s - mean) / (std + 1e-6) for s in scores]


def test_a_failed_trajectory_stays_in_its_group_out_of_the_loss_and_the_baseline(qwen3):
    """One failure path: the hung trajectory (tool_timeout) keeps its place, marked failed through
    Experience.mark_failed; the judge never sees it, it has no reward (None, not 0.0), and its group's
    advantages are the GRPO statistics of the two members left, computed here by hand."""
    exp, measured, judged = _maker_run(qwen3, [[1, None, 4], [3, 6, 2]])
    assert len(exp) == 6 and exp.group_index == [0, 0, 0, 1, 1, 1]  # the group keeps its shape
    assert exp.outcomes == ["ok", "tool_timeout", "ok", "ok", "ok", "ok"] and exp.failed_by[1] == "multi_turn"
    assert exp.scores == [.1, None, .4, .3, .6, .2] and exp.rewards[1] is None
    assert exp.in_loss == [True, False, True, True, True, True]
    assert measured["multi_turn/failed"] == 1 and measured["multi_turn/finish/tool_timeout"] == 1
    assert (judged["reward/failed"], judged["reward/failed/multi_turn"], judged["reward/masked_samples"],
            judged["reward/dropped_groups"]) == (1, 1, 1, 0)
    want = _grpo([.1, .4]) + _grpo([.3, .6, .2])
    got = [a[0] for i, a in enumerate(exp.advantages) if i != 1]
    assert got == pytest.approx(want, abs=1e-6)
    assert all(x == 0.0 for x in exp.advantages[1])
    mask = exp.response_mask()
    for i in range(6):
        assert mask[i, :len(exp.sampled_mask[i])].tolist() == [float(x) for x in exp.sampled_mask[i]]
        assert all(a == 0.0 for a, m in zip(exp.advantages[i], exp.sampled_mask[i]) if not m)
    assert exp.response_mask(loss_only=True)[1].sum() == 0  # the failed sample carries no loss


def test_a_group_left_too_small_by_failed_trajectories_is_dropped_and_counted(qwen3):
    """reward.failed.min_group_size applies to multi-turn failures as to judges': two of three hung, the group
    has one scored member left and is dropped whole; the other group is untouched."""
    exp, measured, judged = _maker_run(qwen3, [[None, 5, None], [3, 6, 2]])
    assert exp.outcomes[:3] == ["tool_timeout", "ok", "tool_timeout"] and exp.scores[1] == .5
    assert exp.reward_masked == [True, True, True, False, False, False]
    assert (judged["reward/failed"], judged["reward/masked_samples"], judged["reward/dropped_groups"]) == (2, 3, 1)
    assert [a[0] for a in exp.advantages] == pytest.approx([0.0] * 3 + _grpo([.3, .6, .2]), abs=1e-6)


def test_a_generation_that_fails_after_the_groups_retries_fails_its_trajectories(qwen3):
    """The rollout group retries and restarts engines itself; what still raises (retries used up, an engine that
    cannot come back) ends the trajectories that waited on it as generation_error: failed, counted, no reward."""
    tools = ToolSet([FunctionTool(add)])
    calls = []

    def generate(prompts, sampling, sessions=None):
        calls.append(len(prompts))
        if len(calls) > 1:
            raise RuntimeError("rollout chunk 0 failed 3 times (rollout.max_retries=2)")
        return ScriptedPolicy(qwen3, lambda u, t: _call("add", {"a": 1}), prompts_)(prompts, sampling)

    runner = AgentRunner(MultiTurnConfig(function_tools=["x:y"]), qwen3, tools, max_response_length=512)
    prompts_ = _prompts(qwen3, tools, 3)
    trajs, m = runner.run([(p, {}, "") for p in prompts_], SamplingParams(max_new_tokens=512), generate)
    assert [t.finish_reason for t in trajs] == ["generation_error"] * 3 and all(t.failed for t in trajs)
    assert m["multi_turn/finish/generation_error"] == 3 and m["multi_turn/failed"] == 3


def test_a_tool_returning_garbage_is_sent_back_as_text(qwen3):
    def odd(x: int):
        """Returns no string.

        Args:
            x: a number
        """
        return {"weird": [x, None]}

    tools = ToolSet([FunctionTool(odd)])
    trajs, _, _, _ = _run(qwen3, tools, lambda u, t: _call("odd", {"x": 5}) if t == 0 else "ok",
                          MultiTurnConfig(function_tools=["x:y"]))
    t = trajs[0]
    assert t.finish_reason == "stop" and "{'weird': [5, None]}" in qwen3.decode(t.response_ids[t.turns[1].start:t.turns[1].end])


class GuessEnv:
    """A user simulator: says 'higher' / 'lower' until the guess is 6; reward 1 when it is."""

    def reset(self, extra_info):
        self.target = 6

    async def step(self, text):
        from mgrpo.agent.environment import EnvStep

        guess = int(text.split()[-1])
        if guess == self.target:
            return EnvStep(reward=1.0, done=True)
        return EnvStep(messages=[{"role": "user", "content": "higher" if guess < self.target else "lower"}])


class CrashEnv(GuessEnv):
    def step(self, text):
        raise KeyError("the simulator fell over")


def test_an_environment_continues_the_conversation_and_its_crash_fails_the_trajectory(qwen3):
    guesses = [3, 8, 6]
    script = lambda uid, turn: f"<think>\nguess {turn}\n</think>\n\n{guesses[turn]}"  # noqa: E731
    runner = AgentRunner(MultiTurnConfig(environment="x:y"), qwen3, ToolSet([]), max_response_length=512,
                         environment=GuessEnv)
    prompts = _prompts(qwen3, ToolSet([]), 1)
    trajs, m = runner.run([(prompts[0], {}, "")], SamplingParams(max_new_tokens=512),
                          ScriptedPolicy(qwen3, script, prompts))
    t = trajs[0]
    assert t.finish_reason == "stop" and t.tool_reward == 1.0 and len(t.turns) == 5
    env_text = qwen3.decode(t.response_ids[t.turns[1].start:t.turns[1].end])
    assert env_text == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"
    # Qwen3's template drops the think blocks of turns before the last user message: the run trains on what
    # the model saw (keep_thinking), and the drift check counts exactly those blocks' tokens
    think = sum(len(qwen3(f"<think>\nguess {k}\n</think>\n\n", add_special_tokens=False)["input_ids"]) for k in (0, 1))
    assert runner.drift(t, [{"role": "user", "content": "question 0"}], []) == think

    runner.environment = CrashEnv
    trajs, m = runner.run([(prompts[0], {}, "")], SamplingParams(max_new_tokens=512),
                          ScriptedPolicy(qwen3, script, prompts))
    assert trajs[0].finish_reason == "env_failed" and trajs[0].failed and m["multi_turn/env_errors"] == 1


def test_the_doctor_leaves_context_tokens_out_of_the_mismatch():
    import math

    from mgrpo.doctor.trajectories import parse_line

    row = {"step": 1, "prompt_ids": [1], "response_ids": [5, 6, 7, 8], "rollout_logprobs": [-1.0, 0.0, 0.0, -2.0],
           "trainer_logprobs": [-1.25, -3.0, -4.0, -2.0], "sampled_mask": [1, 0, 0, 1]}
    line = parse_line(json.dumps(row), 3, "t.jsonl")
    d = line.diffs
    assert d[0] == 0.25 and d[3] == 0.0 and math.isnan(d[1]) and math.isnan(d[2]) and line.context_tokens == 2


@pytest.mark.integration
def test_the_code_tool_runs_in_the_sandbox_and_its_outcomes_are_step_metrics(qwen3):
    """rollout.multi_turn.function_tools naming `mgrpo.sandbox.tool:python`: the experience maker makes the
    sandbox from cfg.sandbox, each call runs there (the model sees its output), and the step's metrics carry
    every call's outcome."""
    import dataclasses
    from types import SimpleNamespace

    from mgrpo.components.experience_maker import ExperienceMaker
    from mgrpo.config import MGRPOConfig
    from mgrpo.data.dataset import PromptItem

    spec = "mgrpo.sandbox.tool:python"
    tools = ToolSet.from_config([spec], None)
    cfg = MGRPOConfig()
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, tokenizer="qwen3"),
                              sandbox=dataclasses.replace(cfg.sandbox, wall_time_s=1.0, cpu_time_s=2),
                              data=dataclasses.replace(cfg.data, max_response_length=512),
                              rollout=dataclasses.replace(cfg.rollout, n=2, multi_turn=MultiTurnConfig(
                                  enable=True, function_tools=[spec])))
    prompts = _prompts(qwen3, tools, 2)
    schemas = tools.schemas(list(tools.tools))
    items = [PromptItem(index=i, prompt_ids=prompts[i], prompt_text="", data_source="s", ground_truth="42",
                        messages=[{"role": "user", "content": f"question {i}"}], tools=schemas) for i in range(2)]
    codes = ["print(6 * 7)", "import time\nwhile True: pass"]  # prompt 1's samples loop past the wall limit

    def generate(prompts_, n, params, desc, sessions=None):  # the rollout group's signature; n is 1 per turn
        out = []
        for ids in prompts_:
            text = (_call("python", {"code": codes[prompts.index(ids)]}) if ids in prompts
                    else "<think>\nok\n</think>\n\n42")
            new = qwen3(text, add_special_tokens=False)["input_ids"] + [qwen3.eos_token_id]
            out.append(GenerateResult(uid=0, token_ids=new, logprobs=[-0.5] * len(new), finish_reason="stop",
                                      weight_version=0))
        return out, SimpleNamespace(retries=0, restarts=0, auth_refused=0)

    maker = ExperienceMaker(cfg, tokenizer=qwen3, train_data=None, judger=None,
                            rollout=SimpleNamespace(generate=generate), tools=tools)
    try:
        exp, measured = maker.generate(items, 2, SamplingParams(max_new_tokens=256))
    finally:
        maker.close()
    assert (measured["sandbox/calls"], measured["sandbox/ok"], measured["sandbox/timeout"]) == (4, 2, 2), measured
    replies = [t["text"] for traj in exp.turns for t in traj["turns"] if t["role"] == "tool"]
    assert sorted(r.splitlines()[0] for r in replies)[:2] == ["42", "42"], replies


# --- veRL's rollout.over_sample_rate: the long tail is cut, aborted, counted, never in a group -------------
def test_over_sample_rate_aborts_the_slowest_trajectories(qwen3):
    """veRL's rule: with N=10 and rate 0.2 the step ends when int(10 x 0.8) = 8 trajectories have finished; the two
    waiting on a 20 s tool end as 'aborted' at once, the engines' abort is asked once, and nothing is waited for."""
    async def slow(x: int) -> str:
        """Slow.

        Args:
            x: a number
        """
        await asyncio.sleep(20.0)
        return "1"

    tools = ToolSet([FunctionTool(slow), FunctionTool(add)])
    script = lambda uid, turn: (_call("slow" if uid in (3, 7) else "add", {"x": 1} if uid in (3, 7) else {"a": 1})  # noqa: E731
                                if turn == 0 else "done")
    runner = AgentRunner(MultiTurnConfig(function_tools=["x:y"]), qwen3, tools, max_response_length=1024)
    prompts = _prompts(qwen3, tools, 10)
    aborts = []
    t0 = time.monotonic()
    trajs, m = runner.run([(p, {}, "") for p in prompts], SamplingParams(max_new_tokens=10_000),
                          ScriptedPolicy(qwen3, script, prompts), over_sample_rate=0.2,
                          abort=lambda: aborts.append(time.monotonic()))
    assert time.monotonic() - t0 < 10
    assert [t.finish_reason for t in trajs] == ["stop"] * 3 + ["aborted"] + ["stop"] * 3 + ["aborted"] + ["stop"] * 2
    assert m["rollout/aborted"] == 2 and m["multi_turn/finish/aborted"] == 2 and len(aborts) == 1
    assert trajs[3].failed and trajs[3].turns[0].calls[0]["name"] == "slow"  # what it did before the cut is kept
    assert {t.weight_version for t in trajs} == {3}  # the policy's version (ScriptedPolicy)

    # cut before their first turn (an environment that is slow to start every fourth episode): no token, no turn,
    # and the batch's weight version, so that a staleness bound does not drop them as version 0
    from tests.helpers.agent import SlowEveryFourth

    runner = AgentRunner(MultiTurnConfig(function_tools=["x:y"]), qwen3, tools, max_response_length=1024,
                         environment=SlowEveryFourth)
    prompts = _prompts(qwen3, tools, 8)
    trajs, m = runner.run([(p, {}, "") for p in prompts], SamplingParams(max_new_tokens=10_000),
                          ScriptedPolicy(qwen3, lambda u, t: "done", prompts), over_sample_rate=0.25)
    cut = [t for t in trajs if t.finish_reason == "aborted"]
    assert len(cut) == 2 and m["rollout/aborted"] == 2 and all(not t.turns and not t.response_ids for t in cut)
    assert {t.weight_version for t in trajs} == {3}


def test_aborted_samples_leave_their_group_and_are_not_failures(qwen3):
    """An aborted trajectory goes through the failed-sample path with outcome 'aborted' (by over_sample): out of
    the loss and its group's baseline (GRPO over the members left, by hand), counted in rollout/aborted and not
    in reward/failed or the failure rate (reward.failed.max_rate would refuse a 1-in-3 failure rate of 0.2)."""
    from mgrpo.agent.trajectory import Trajectory
    from mgrpo.config import MGRPOConfig
    from mgrpo.data.dataset import PromptItem
    from mgrpo.experience import Experience
    from mgrpo.rewards import Judger

    item = PromptItem(index=0, prompt_ids=[1, 2], prompt_text="", data_source="s", ground_truth="3")
    trajs = []
    for uid, answer in enumerate(["2", None, "5"]):
        t = Trajectory(uid=uid, prompt_ids=[1, 2])
        if answer is None:
            t.finish_reason = "aborted"
        else:
            ids = qwen3(answer, add_special_tokens=False)["input_ids"] + [qwen3.eos_token_id]
            t.add(ids, [-0.1] * len(ids), "assistant", text=answer + qwen3.eos_token)
            t.finish_reason = "stop"
        trajs.append(t)
    exp = Experience.from_trajectories([item], trajs, 3)
    cfg = MGRPOConfig()
    cfg.reward.custom_functions = {"s": "tests.helpers.reward_fns:flaky_digit_reward"}
    cfg.reward.num_workers = 0
    cfg.reward.failed.max_rate = 0.2
    with Judger(cfg.reward) as judger:
        got = exp.judge(judger, qwen3, cfg)
    assert exp.outcomes == ["ok", "aborted", "ok"] and exp.failed_by[1] == "over_sample"
    assert exp.scores == [.2, None, .5] and exp.reward_masked == [False, True, False]
    assert got["reward/failed"] == 0 and got["reward/masked_samples"] == 1
    exp.compute_advantages(cfg)
    assert [a[0] for a in exp.advantages if a] == pytest.approx(_grpo([.2, .5]), abs=1e-6)


def test_a_failed_sample_without_response_tokens_goes_through_the_batch_path():
    """A trajectory cut or failed before its first turn has no response token; it keeps its place in the batch
    (its group's shape), so the trainer's sharding and micro-batches must take a 0-token response: packed and
    padded, every per-token field as long as the tokens, log-probs split back with an empty row for it."""
    from mgrpo.components.actor_client import ActorClient
    from mgrpo.config import MGRPOConfig
    from mgrpo.experience import Experience
    from mgrpo.training.batch import batch_layout, build_micro_batch, split_per_sample

    cfg = MGRPOConfig()
    masks = [[1, 1, 0, 1], [], [1, 1, 1]]
    exp = Experience(prompt_ids=[[1, 2], [3], [4, 5, 6]], response_ids=[[3] * len(m) for m in masks],
                     rollout_logprobs=[[-1.0] * len(m) for m in masks], finish_reasons=["stop"] * 3,
                     weight_versions=[0] * 3, group_index=[0, 0, 0], in_loss=[True] * 3, sampled_mask=masks)
    exp.mark_failed(1, "aborted", "over_sample")
    exp.reward_masked, exp.rewards = [False, True, False], [1.0, None, 0.0]
    exp.compute_advantages(cfg)
    assert exp.advantages[1] == [] and exp.advantages[0][0] == pytest.approx(-exp.advantages[2][0])
    exp.old_logprobs = exp.ref_logprobs = [[-1.0] * len(m) for m in masks]
    for packed in (True, False):
        (shard,) = ActorClient(None, cfg, dp=1)._shards(exp, range(3), for_training=True)
        mb = build_micro_batch(shard, batch_layout(packed=packed))
        assert mb.response_lens == [4, 0, 3] and mb.fields["advantages"].shape == (7,)
        assert [len(x) for x in split_per_sample(mb.fields["old_logprobs"], mb.response_lens)] == [4, 0, 3]


def test_a_ready_multi_turn_batch_survives_the_checkpoint_unchanged(qwen3):
    """One-step-off rollout saves the batches it has ready with each checkpoint and replays them on resume
    (components/rollout_pipeline.py). A multi-turn batch with a failed trajectory comes back field for field:
    masks, turns, tool rewards and the failed sample's outcome, so a resumed step trains on exactly what the
    killed run would have, its failed sample still out of the loss and the baseline."""
    import json

    from mgrpo.components.rollout_pipeline import experience_from_json, experience_to_json

    exp, _, _ = _maker_run(qwen3, [[1, None, 4], [3, 6, 2]])
    items = list({id(it): it for it in exp.items}.values())
    saved = json.loads(json.dumps(experience_to_json(exp)))  # what pending_rollouts.json holds
    back = experience_from_json(saved, items)
    for name in ("prompt_ids", "response_ids", "rollout_logprobs", "sampled_mask", "turns", "tool_rewards",
                 "outcomes", "failed_by", "reward_masked", "scores", "rewards", "in_loss", "group_index",
                 "advantages"):
        assert getattr(back, name) == getattr(exp, name), name
    assert [it.index for it in back.items] == [it.index for it in exp.items]
    assert back.outcomes[1] == "tool_timeout" and back.response_mask(loss_only=True)[1].sum() == 0
