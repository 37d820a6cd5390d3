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
from tests.helpers.agent import ScriptedPolicy, add, slow_tool, call_text as _call, tool_prompts as _prompts
from tests.helpers.sandbox import require_any_level


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    from mgrpo.data.tokenizer import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: what to look up
    """
    return f"value-of-{key}" * 40  # long: truncated by max_tool_response_length


def boom(x: int) -> str:
    """Always raises."""
    raise RuntimeError("kaput")



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
        trajs, m, took, _ = _run(qwen3, tools, script, MultiTurnConfig(function_tools=["x:y"], tool_timeout_s=0.5,
                                                                   trajectory_retries=0), k=2)
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
    tools = ToolSet([FunctionTool(slow_tool(2.0)), FunctionTool(add)])
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
    cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(cfg.algorithm, loss_agg_mode=mode,
                                                                 entropy_coeff=0.0))  # the masks alone
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
    # one retry (rollout.multi_turn.trajectory_retries' default), then failed: both crashes counted
    assert trajs[0].finish_reason == "env_failed" and trajs[0].failed and m["multi_turn/env_errors"] == 2
    assert m["multi_turn/trajectory_retries/env_failed"] == 1


def test_a_turn_a_stop_string_ended_gets_the_templates_end_of_turn_as_context(qwen3):
    """rollout.stop ends a turn inside the model's text (SGLang keeps the stop, no EOS follows): the next
    message is appended after the template's <|im_end|>, which is context (never sampled), and the conversation
    still renders to the same ids as the chat template's (drift: only the think blocks, as without stops)."""
    guesses = [3, 8, 6]
    script = lambda uid, turn: f"<think>\nguess {turn}\n</think>\n\n{guesses[turn]} is my guess"  # noqa: E731
    runner = AgentRunner(MultiTurnConfig(environment="x:y"), qwen3, ToolSet([]), max_response_length=512,
                         environment=GuessEnv)
    prompts = _prompts(qwen3, ToolSet([]), 1)
    policy = ScriptedPolicy(qwen3, script, prompts)
    trajs, m = runner.run([(prompts[0], {}, "")], SamplingParams(max_new_tokens=512, stop=("3", "8", "6")), policy)
    t = trajs[0]
    assert t.finish_reason == "stop" and t.tool_reward == 1.0 and len(t.turns) == 5
    assert all(qwen3.decode(s).endswith(str(g)) for s, g in zip(policy.sampled[0], guesses))  # no EOS sampled
    for k in (1, 3):
        span = t.response_ids[t.turns[k].start:t.turns[k].end]
        assert qwen3.decode(span).startswith("<|im_end|>\n<|im_start|>user\n") and not any(t.sampled[t.turns[k].start:
                                                                                                       t.turns[k].end])
    think = sum(len(qwen3(f"<think>\nguess {k}\n</think>\n\n", add_special_tokens=False)["input_ids"]) for k in (0, 1))
    assert runner.drift(t, [{"role": "user", "content": "question 0"}], []) == think


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

    require_any_level()
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

    maker = ExperienceMaker(cfg, tokenizer=qwen3, train_data=None, rubric=None,
                            rollout=SimpleNamespace(generate=generate), tools=tools)
    try:
        exp, measured = maker.generate(items, 2, SamplingParams(max_new_tokens=256))
    finally:
        maker.close()
    assert (measured["sandbox/calls"], measured["sandbox/ok"], measured["sandbox/timeout"]) == (4, 2, 2), measured
    replies = [t["text"] for traj in exp.turns for t in traj["turns"] if t["role"] == "tool"]
    assert sorted(r.splitlines()[0] for r in replies)[:2] == ["42", "42"], replies
