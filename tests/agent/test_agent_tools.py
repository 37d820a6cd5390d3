"""The user's own tools under the runner: plain function tools (strict schemas, hidden per-record values), the
warnings a silent failure would otherwise hide (calls that mostly cannot run, a budget no call fits, prompts
that are too long and why), tool classes given by file, and every tool fault contained and counted (a reply
that cannot be read, a reward that is not a number, a calc_reward that raises, a hung sync tool at exit), and
what the trajectory lines say of a multi-turn sample (its real ending, per-token advantages)."""

from __future__ import annotations

import json
import logging
import re
import math
import os
import subprocess
import sys
import textwrap

import pytest

from mgrpo.agent.parse import ToolCallParser
from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.tools import BaseTool, FunctionTool, ToolSet, function_schema, function_tools_strict, \
    load_verl_tool_config
from mgrpo.config import ConfigError
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.rollout.types import SamplingParams
from tests.helpers import ROOT
from tests.helpers.agent import ScriptedPolicy, add, call_text as _call, tool_prompts as _prompts


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    from mgrpo.data.tokenizer import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def _run(tok, tools, script, cfg, *, k=1, extra=None, max_response_length=1024):
    runner = AgentRunner(cfg, tok, tools, max_response_length=max_response_length)
    prompts = _prompts(tok, tools, k)
    trajs, m = runner.run([(p, extra or {}, f"data.jsonl:{i + 1}") for i, p in enumerate(prompts)],
                          SamplingParams(max_new_tokens=4096), ScriptedPolicy(tok, script, prompts))
    return trajs, m


def _replies(tok, t) -> str:
    return "".join(tok.decode(t.response_ids[x.start:x.end]) for x in t.turns if x.role == "tool")


# --- plain function tools: strict schemas, hidden per-record values ----------------------------------------
def lookup(key: str, *, secret: int) -> str:
    """Look a key up in the record's table.

    Args:
        key: what to look up
    """
    return f"{key}={secret}"


def test_function_tools_are_strict_where_calls_are_forced_and_the_grammar_then_writes_their_arguments():
    assert (function_tools_strict("auto", 0, None), function_tools_strict("required", 0, None),
            function_tools_strict("auto", 6, None), function_tools_strict("auto", 6, False)) == (False, True, True, False)
    strict = FunctionTool(add, strict=True)
    assert strict.tool_schema["function"]["strict"] is True
    assert "strict" not in FunctionTool(add).tool_schema["function"]  # an auto run's prompts are unchanged

    def tag(tool) -> dict:
        kind, value = ToolCallParser("qwen25", [tool.tool_schema]).constraint("required")
        assert kind == "structural_tag"
        return json.loads(value)

    def args_schema(tag: dict) -> list:  # the schemas the grammar writes a call's arguments by
        return [x["schema"] for x in tag["structures"]]

    # not strict: the arguments may be any JSON (a forced call wrote "arguments": true); strict: add's schema
    assert args_schema(tag(FunctionTool(add))) == [{}]
    assert args_schema(tag(strict)) == [function_schema(add)["function"]["parameters"]]

    def own(a: int) -> int:
        """Own."""
        return a
    own.strict = False  # the per-tool override beats the run's choice
    assert "strict" not in FunctionTool(own, strict=True).tool_schema["function"]


def test_a_function_tools_keyword_only_parameters_are_hidden_and_filled_per_record(qwen3):
    """`*, secret` is not in the schema the model sees; each record's tools_kwargs fill it (create_kwargs, as a
    veRL tool's); the model naming it is a bad argument, and a record that gives none is a counted tool error."""
    assert function_schema(lookup)["function"]["parameters"] == {
        "type": "object", "properties": {"key": {"type": "string", "description": "what to look up"}},
        "required": ["key"]}
    tools = ToolSet([FunctionTool(lookup)])
    script = lambda uid, turn: _call("lookup", {"key": "k"}) if turn == 0 else "done"  # noqa: E731
    extra = {"tools_kwargs": {"lookup": {"create_kwargs": {"secret": 7}}}}
    (t,), m = _run(qwen3, tools, script, MultiTurnConfig(function_tools=["x:y"]), extra=extra)
    assert t.finish_reason == "stop" and "k=7" in _replies(qwen3, t) and m.get("multi_turn/tool_errors", 0) == 0
    assert tools.tools["lookup"].records == {}  # released at the trajectory's end

    cheat = lambda uid, turn: _call("lookup", {"key": "k", "secret": 1}) if turn == 0 else "done"  # noqa: E731
    (t,), m = _run(qwen3, tools, cheat, MultiTurnConfig(function_tools=["x:y"]), extra=extra)
    assert m["multi_turn/bad_arguments"] == 1 and "k=1" not in _replies(qwen3, t)

    (t,), m = _run(qwen3, tools, script, MultiTurnConfig(function_tools=["x:y"]))
    assert m["multi_turn/tool_raised"] == 1 and "extra_info.tools_kwargs.lookup.create_kwargs" in _replies(qwen3, t)


class _OldStyle:
    """Written for veRL's SGLang rollout, which called create(request_id, **create_kwargs); makes no id itself."""

    def __init__(self, config, tool_schema):
        self.tool_schema, self.secrets = tool_schema, {}

    async def create(self, instance_id=None, secret=None):
        self.secrets[instance_id] = secret
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        return f"secret={self.secrets[instance_id]}", 0.0, {}

    async def release(self, instance_id, **kwargs):
        self.secrets.pop(instance_id)


class _AgentLoopStyle(_OldStyle):
    """Written for veRL's agent loop, which calls create(create_kwargs={...}) and reads them from kwargs."""

    async def create(self, instance_id=None, **kwargs):
        self.secrets[instance_id] = kwargs["create_kwargs"]["secret"]
        return instance_id, None


@pytest.mark.parametrize("cls", [_OldStyle, _AgentLoopStyle])
def test_a_verl_tool_class_of_either_rollout_gets_its_own_instance_and_its_records_values(qwen3, cls):
    schema = {"type": "function", "function": {"name": "secret", "description": "The secret.",
                                               "parameters": {"type": "object", "properties": {}}}}
    tool = cls({}, schema)
    tools = ToolSet([tool])
    runner = AgentRunner(MultiTurnConfig(), qwen3, tools, max_response_length=1024)
    prompts = _prompts(qwen3, tools, 3)
    records = [(p, {"tools_kwargs": {"secret": {"create_kwargs": {"secret": 10 + i}}}}, f"data.jsonl:{i + 1}")
               for i, p in enumerate(prompts)]
    script = lambda uid, turn: _call("secret", {}) if turn == 0 else "done"  # noqa: E731
    trajs, m = runner.run(records, SamplingParams(max_new_tokens=4096), ScriptedPolicy(qwen3, script, prompts))
    # each trajectory's reply is its own record's value (one shared instance id would give every one the last)
    assert [_replies(qwen3, t).count(f"secret={10 + i}") for i, t in enumerate(trajs)] == [1, 1, 1]
    assert m.get("multi_turn/tool_errors", 0) == 0 and m["multi_turn/tool_calls"] == 3 and tool.secrets == {}  # released


# --- what would fail silently: mostly invalid calls, a budget no call fits -----------------------------------
def test_a_batch_whose_calls_mostly_cannot_run_is_warned_about_and_counted(qwen3, caplog):
    tools = ToolSet([FunctionTool(add)])
    bad = lambda uid, turn: _call("add", {"c": 1}) if turn == 0 else "done"  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="mgrpo"):
        _, m = _run(qwen3, tools, bad, MultiTurnConfig(function_tools=["x:y"]), k=3)
    assert (m["multi_turn/invalid_calls"], m["multi_turn/invalid_call_rate"], m["multi_turn/mostly_invalid_batches"]) \
        == (3, 1.0, 1)
    assert "3 of the 3 tool calls the model wrote in this batch could not run (bad arguments 3" in caplog.text
    key = re.search(r"rollout\.multi_turn\.(\w+)", caplog.text).group(1)  # the key it names is one a user can set
    assert key == "strict_function_tools" and hasattr(MultiTurnConfig(), key)
    caplog.clear()
    good = lambda uid, turn: _call("add", {"a": 1}) if turn == 0 else "done"  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="mgrpo"):
        _, m = _run(qwen3, tools, good, MultiTurnConfig(function_tools=["x:y"]), k=3)
    assert (m["multi_turn/invalid_calls"], m["multi_turn/mostly_invalid_batches"]) == (0, 0) and not caplog.text


def test_a_response_budget_that_fits_no_call_is_said_at_start_and_counted(qwen3, caplog):
    tools = ToolSet([FunctionTool(add)])
    shortest = len(qwen3('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
                         add_special_tokens=False)["input_ids"])
    with caplog.at_level(logging.WARNING, logger="mgrpo"):
        runner = AgentRunner(MultiTurnConfig(function_tools=["x:y"]), qwen3, tools, max_response_length=4)
    assert runner.shortest_call == shortest
    assert f"no tool call can complete: the shortest (a call with no arguments) is {shortest} tokens and an " \
           "assistant turn may write 4" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mgrpo"):
        AgentRunner(MultiTurnConfig(function_tools=["x:y"]), qwen3, tools, max_response_length=shortest)
    assert not caplog.text
    _, m = _run(qwen3, tools, lambda u, t: _call("add", {"a": 1}), MultiTurnConfig(function_tools=["x:y"]),
                max_response_length=4)
    assert m["multi_turn/call_cannot_fit"] == 1 and m["multi_turn/finish/length"] == 1


def test_prompts_all_too_long_are_refused_naming_their_lengths_and_the_tool_schemas_share(qwen3, tmp_path):
    from mgrpo.config.schema import DataConfig
    from mgrpo.data.dataset import PromptDataset

    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"data_source": "s", "prompt": [{"role": "user", "content": q}],
                                        "reward_model": {"ground_truth": "1"}}) + "\n" for q in ("hi", "hello there")))
    tools = ToolSet([FunctionTool(add)])
    schemas = tools.schemas(["add"])
    render = lambda q, with_tools: len(qwen3(qwen3.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": q}], tools=schemas if with_tools else None, tokenize=False,
        add_generation_prompt=True, enable_thinking=DataConfig().enable_thinking), add_special_tokens=False)["input_ids"])
    longest, bare = render("hello there", True), render("hello there", False)
    content = len(qwen3("hello there", add_special_tokens=False)["input_ids"])
    with pytest.raises(ConfigError) as err:
        PromptDataset(DataConfig(max_prompt_length=32), qwen3, [str(path)], tools_for=lambda e, w: schemas)
    assert f"are longer than data.max_prompt_length=32 tokens: {render('hi', True)} to {longest} tokens; the " \
           f"longest ({path}:2) is {longest} tokens: its messages' text {content}, the tool schemas in the system " \
           f"prompt {longest - bare}, the chat template {bare - content}" in str(err.value)


def test_a_tool_class_is_given_by_file_as_a_reward_function_is(tmp_path):
    """class_name 'tools/mine.py:Mine' (relative to the YAML's folder): loaded without PYTHONPATH."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "mine.py").write_text(textwrap.dedent("""
        from mgrpo.agent.tools import BaseTool

        class Mine(BaseTool):
            async def execute(self, instance_id, parameters, **kwargs):
                return "mine", None, {}
    """))
    yaml = tmp_path / "tools.yaml"
    yaml.write_text("tools:\n  - class_name: tools/mine.py:Mine\n    config: {}\n    tool_schema:\n      type: function\n"
                    "      function: {name: mine, description: d, parameters: {type: object, properties: {}}}\n")
    (tool,) = load_verl_tool_config(str(yaml))
    assert type(tool).__name__ == "Mine" and tool.name == "mine"
    yaml.write_text(yaml.read_text().replace("tools/mine.py:Mine", "nowhere_pkg.mine.Mine"))
    with pytest.raises(ValueError, match=r"tools\[0\]: field 'class_name': cannot load 'nowhere_pkg.mine.Mine' .*"
                                         r"or give its file: 'nowhere_pkg/mine.py:Mine'"):
        load_verl_tool_config(str(yaml))


# --- tool faults: contained, counted, named --------------------------------------------------------------
class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


def unprintable(x: int):
    """Returns what cannot be printed."""
    return Unprintable()


class Rewarding(BaseTool):
    """A veRL tool whose step reward is whatever the call's `r` says ('nan', 'high' or a number), and whose
    calc_reward raises when asked; it records what it released."""

    released: list[str] = []

    async def execute(self, instance_id, parameters, **kwargs):
        r = parameters.get("r")
        reward = {"nan": math.nan, "high": "high"}.get(r, r)
        return "ok", reward, {}

    async def calc_reward(self, instance_id, **kwargs):
        if kwargs.get("boom"):
            raise ValueError("calc_reward fell over")
        return 0.25

    async def release(self, instance_id, **kwargs):
        Rewarding.released.append(instance_id)


def _rewarding() -> Rewarding:
    return Rewarding({}, {"type": "function", "function": {
        "name": "rew", "description": "d", "parameters": {"type": "object", "properties": {"r": {}}}}})


def test_a_reply_that_cannot_be_read_as_text_is_a_counted_tool_error(qwen3):
    tools = ToolSet([FunctionTool(unprintable)])
    (t,), m = _run(qwen3, tools, lambda u, turn: _call("unprintable", {"x": 1}) if turn == 0 else "done",
                   MultiTurnConfig(function_tools=["x:y"]))
    assert t.finish_reason == "stop" and (m["multi_turn/bad_replies"], m["multi_turn/tool_errors"]) == (1, 1)
    assert "unprintable's reply cannot be read as text (RuntimeError: no text)" in _replies(qwen3, t)


@pytest.mark.parametrize("bad", ["nan", "high"])
def test_a_step_reward_that_is_not_a_number_is_a_tool_error_never_a_score(qwen3, bad):
    tools = ToolSet([_rewarding()])
    script = lambda u, turn: [_call("rew", {"r": 0.5}), _call("rew", {"r": bad})][turn] if turn < 2 else "done"  # noqa: E731
    (t,), m = _run(qwen3, tools, script, MultiTurnConfig(function_tools=["x:y"]))
    # 0.5 (the good step) + 0.25 (calc_reward); the bad step's reward is counted, named, and left out
    assert t.finish_reason == "stop" and t.tool_reward == 0.75
    assert (m["multi_turn/bad_tool_rewards"], m["multi_turn/tool_errors/rew"]) == (1, 1)
    assert any("rew's step reward is" in e for x in t.turns for e in x.errors)


def test_release_runs_when_calc_reward_raises(qwen3):
    Rewarding.released.clear()
    tools = ToolSet([_rewarding()])
    extra = {"tools_kwargs": {"rew": {"calc_reward_kwargs": {"boom": True}}}}
    (t,), m = _run(qwen3, tools, lambda u, turn: _call("rew", {"r": 1}) if turn == 0 else "done",
                   MultiTurnConfig(function_tools=["x:y"]), extra=extra)
    assert len(Rewarding.released) == 1 and t.tool_reward == 1.0
    assert m["multi_turn/tool_release_errors"] == 1 and m["multi_turn/tool_release_errors/rew"] == 1


def test_an_environment_step_reward_that_is_not_a_number_fails_its_trajectory_counted(qwen3):
    from mgrpo.agent.environment import EnvStep

    class NanEnv:
        def reset(self, extra_info):
            pass

        def step(self, text):
            return EnvStep(reward=math.nan, done=True)

    runner = AgentRunner(MultiTurnConfig(environment="x:y", trajectory_retries=0), qwen3, ToolSet([]),
                         max_response_length=64, environment=NanEnv)
    prompts = _prompts(qwen3, ToolSet([]), 1)
    (t,), m = runner.run([(prompts[0], {}, "")], SamplingParams(max_new_tokens=64),
                         ScriptedPolicy(qwen3, lambda u, turn: "5", prompts))
    assert t.finish_reason == "env_failed" and t.tool_reward == 0.0 and m["multi_turn/env_errors"] == 1
    assert "step reward is nan" in t.counts["env_error"]


HUNG = """
import time, sys, json
from transformers import AutoTokenizer
from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.tools import FunctionTool, ToolSet
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.data.tokenizer import qwen3_tokenizer_dir
from mgrpo.rollout.types import SamplingParams
from tests.helpers.agent import ScriptedPolicy, call_text, tool_prompts

def hang(x: int) -> str:
    \"\"\"Never returns.\"\"\"
    while True:
        time.sleep(1)

tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
tools = ToolSet([FunctionTool(hang)])
runner = AgentRunner(MultiTurnConfig(function_tools=["x:y"], tool_timeout_s=0.5, trajectory_retries=0), tok, tools,
                     max_response_length=256)
prompts = tool_prompts(tok, tools, 1)
(t,), m = runner.run([(prompts[0], {}, "")], SamplingParams(max_new_tokens=256),
                     ScriptedPolicy(tok, lambda u, turn: call_text("hang", {"x": 1}), prompts))
import threading
tool = [x.daemon for x in threading.enumerate() if x.name == "mgrpo-sync-hang"]
print(json.dumps({"finish": t.finish_reason, "hung": m["multi_turn/hung_tool_threads"], "tool_thread_daemon": tool}))
"""


@pytest.mark.integration
def test_a_hung_sync_tool_never_holds_the_process_at_exit(tmp_path):
    """A sync tool that never returns: its trajectory ends tool_timeout, the hung thread (a daemon) is counted,
    and the process exits (in an executor's thread, which the interpreter joins at exit, it never did)."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG)
    root = str(ROOT)
    out = subprocess.run([sys.executable, str(script)], cwd=root, capture_output=True, text=True, timeout=240,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"finish": "tool_timeout", "hung": 1,
                                                           "tool_thread_daemon": [True]}


# --- trajectory lines of multi-turn samples ----------------------------------------------------------------
def test_trajectory_lines_carry_the_real_finish_reason_and_per_token_advantages(tmp_path):
    """A forced sample's first tokens are context (advantage 0 there): its line's `advantage` is its first
    loss token's, `advantages` per token; a tool_timeout trajectory's line says tool_timeout, not stop."""
    from mgrpo.agent.trajectory import Trajectory
    from mgrpo.components.observer import Observer
    from mgrpo.data.dataset import PromptItem
    from mgrpo.experience import Experience
    from mgrpo.observe.trajectories import TrajectoryWriter

    item = PromptItem(index=0, prompt_ids=[1, 2], prompt_text="p", data_source="s", ground_truth="3")
    forced = Trajectory(uid=0, prompt_ids=[1, 2], forced=True)
    forced.add([5, 6, 7], [-0.1] * 3, "assistant", sampled=[0, 0, 1])
    forced.finish_reason = "stop"
    hung = Trajectory(uid=1, prompt_ids=[1, 2])
    hung.add([5], [-0.1], "assistant")
    hung.finish_reason = "tool_timeout"
    exp = Experience.from_trajectories([item], [forced, hung], 2)
    exp.response_texts = ["a", "b"]
    exp.scores, exp.rewards = [1.0, None], [1.0, None]
    exp.advantages = [[0.0, 0.0, 0.5], [0.0]]
    path = tmp_path / "trajectories.jsonl"
    obs = Observer.__new__(Observer)  # only the line writer: no tracker, no thread
    obs.token_logprobs, obs.trajectories = False, TrajectoryWriter(str(path))
    obs._write_trajectories(3, exp)
    obs.trajectories.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(x["advantage"], x["advantages"], x["finish_reason"]) for x in lines] == [
        (0.5, [0.0, 0.0, 0.5], "stop"), (0.0, [0.0], "tool_timeout")]
