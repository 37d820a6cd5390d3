"""veRL's own GSM8K tool, as veRL's multi-turn example configures it (its tool-config YAML stored verbatim under
tests/data/verl_scripts/examples/), runs without veRL: the class name resolves to mgrpo/compat/verl/tools.py, and
its replies and step rewards are veRL's, written out here by hand from verl/tools/gsm8k_tool.py for a GSM8K
record laid out as veRL's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it."""

from __future__ import annotations

import asyncio
import json
import os

import pytest
import yaml

from mgrpo.agent.tools import ToolSet
from mgrpo.config import InputError
from tests.helpers import GSM8K_RAW
from tests.helpers.verl_scripts import SCRIPTS

TOOL_CONFIG = SCRIPTS / "examples" / "sglang_multiturn" / "config" / "tool_config" / "gsm8k_tool_config.yaml"
GSM8K = os.path.join(GSM8K_RAW, "train.jsonl")


def _verl_record() -> dict:
    """GSM8K's first training question as veRL's preprocessing lays it out (the fields the tool reads)."""
    with open(GSM8K) as f:
        raw = json.loads(f.readline())
    solution = raw["answer"].split("#### ")[1].replace(",", "")
    return {"data_source": "openai/gsm8k", "reward_model": {"style": "rule", "ground_truth": solution},
            "extra_info": {"need_tools_kwargs": True,
                           "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": solution}}}}}


def test_verl_gsm8k_tool_runs_as_written_with_verls_replies_and_step_rewards():
    tools = ToolSet.from_config([], str(TOOL_CONFIG))
    assert list(tools.tools) == ["calc_gsm8k_reward"]
    written = yaml.safe_load(TOOL_CONFIG.read_text())["tools"][0]
    assert tools.schemas(["calc_gsm8k_reward"]) == [written["tool_schema"]]
    tool = tools.tools["calc_gsm8k_reward"]
    record = _verl_record()
    assert record["reward_model"]["ground_truth"] == "72"

    async def episode():
        kwargs = record["extra_info"]["tools_kwargs"]["calc_gsm8k_reward"]["create_kwargs"]
        iid = await tool.create(**kwargs)
        replies = [await tool.execute(iid, {"answer": a}) for a in ("70", "#### 72", 72, "72")]
        final = await tool.calc_reward(iid)
        await tool.release(iid)
        # veRL's agent loop passes the create kwargs as one argument; both forms create the same state
        other = await tool.create(create_kwargs=kwargs)
        second = await tool.execute(other, {"answer": "The answer is 72."})
        return replies, final, second

    replies, final, second = asyncio.run(episode())
    # veRL: f"Current parsed {answer=} {reward=}", step reward 0.0 when the score improves on the best so far
    # and -0.05 otherwise (a wrong first answer does not improve on 0.0; a repeated right one does not either)
    assert [(r[0], r[1]) for r in replies] == [
        ("Current parsed answer='70' reward=0.0", -0.05),
        ("Current parsed answer='#### 72' reward=1.0", 0.0),
        ("Current parsed answer='72' reward=1.0", -0.05),
        ("Current parsed answer='72' reward=1.0", -0.05)]
    assert final == 1.0
    assert second[0] == "Current parsed answer='The answer is 72.' reward=0.0" and second[1] == -0.05  # flexible: '.'


def test_a_tool_class_that_does_not_load_is_named_by_file_and_entry(tmp_path):
    bad = tmp_path / "tools.yaml"
    entry = yaml.safe_load(TOOL_CONFIG.read_text())["tools"][0]
    bad.write_text(yaml.safe_dump({"tools": [entry, {**entry, "class_name": "verl.tools.no_such.Tool"}]}))
    with pytest.raises(InputError, match=r"tools.yaml: tools\[1\]: field 'class_name': cannot load "
                                         r"'verl.tools.no_such.Tool'"):
        ToolSet.from_config([], str(bad))


INTERACTION_CONFIG = TOOL_CONFIG.parent.parent / "interaction_config" / "gsm8k_interaction_config.yaml"


def test_verl_gsm8k_interaction_runs_as_written_as_an_environment():
    """veRL's interaction config (verbatim) and a record's interaction_kwargs as veRL's
    gsm8k_multiturn_w_interaction.py writes them; replies and turn scores from verl/interactions/gsm8k_interaction.py
    (strict judging: only '#### <answer>' counts). Turn scores stay out of the reward, as in veRL's agent loop."""
    from mgrpo.agent.interaction import InteractionEnvironment, load_interactions

    interactions = load_interactions(str(INTERACTION_CONFIG))
    assert list(interactions) == ["gsm8k"] and interactions["gsm8k"].name == "gsm8k"
    solution = _verl_record()["reward_model"]["ground_truth"]
    extra = {"interaction_kwargs": {"name": "gsm8k", "query": "How many clips?", "ground_truth": solution}}
    prompt = [{"role": "user", "content": "How many clips?"}]

    async def episode():
        env = InteractionEnvironment(interactions)
        await env.reset(extra)
        first = await env.step("It is 72.", prompt + [{"role": "assistant", "content": "It is 72."}])
        msgs = prompt + [{"role": "assistant", "content": "It is 72."}, *first.messages,
                         {"role": "assistant", "content": "#### 72"}]
        second = await env.step("#### 72", msgs)
        await env.close()
        return env, first, second

    env, first, second = asyncio.run(episode())
    assert (first.done, first.messages, first.reward) == (
        False, [{"role": "user", "content": "Your response is incorrect! You need to reflect on your answer and "
                                            "try again."}], None)
    assert (second.done, second.messages, second.reward) == (
        True, [{"role": "user", "content": "Your response is correct!"}], None)
    assert env.scores == [0.0, 1.0] and interactions["gsm8k"]._instances == {}  # finalized

    bad = InteractionEnvironment(interactions)
    with pytest.raises(InputError, match="extra_info.interaction_kwargs.name': 'chess' is not one of the "
                                         r"configured interactions \['gsm8k'\]"):
        asyncio.run(bad.reset({"interaction_kwargs": {"name": "chess"}}))


def test_interaction_runs_in_the_runner_with_the_whole_conversation_and_sticky_sessions():
    """veRL's GSM8K interaction as a trajectory's environment (AgentRunner, the Qwen3 template): it sees the prompt
    and every turn; its replies are context; its scores stay out of the reward; max_user_turns ends the episode;
    every turn of a trajectory carries the trajectory's one session (the key that keeps it on one engine)."""
    from transformers import AutoTokenizer

    from mgrpo.agent.interaction import InteractionEnvironment, load_interactions
    from mgrpo.agent.runner import AgentRunner
    from mgrpo.config.schema import MultiTurnConfig
    from mgrpo.data.tokenizer import qwen3_tokenizer_dir
    from mgrpo.rollout.types import SamplingParams
    from tests.helpers.agent import ScriptedPolicy

    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    interactions = load_interactions(str(INTERACTION_CONFIG))
    seen: list[list[dict]] = []
    real = interactions["gsm8k"].generate_response

    async def spy(iid, messages, **kw):
        seen.append([dict(m) for m in messages])
        return await real(iid, messages, **kw)

    interactions["gsm8k"].generate_response = spy
    extra = {"interaction_kwargs": {"name": "gsm8k", "query": "q", "ground_truth": "72"}}
    prompts = [[{"role": "user", "content": f"How many clips, {i}?"}] for i in range(2)]
    ids = [tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
           ["input_ids"] for m in prompts]

    def run(max_user_turns):
        seen.clear()
        policy = ScriptedPolicy(tok, lambda uid, turn: ["It is 72.", "#### 72"][turn], ids)
        sessions: list[list[str]] = []

        def generate(p, sampling, sessions_=None, **kw):
            sessions.append(list(kw.get("sessions", sessions_) or []))
            return policy(p, sampling)

        runner = AgentRunner(MultiTurnConfig(interaction_config_path="x", max_user_turns=max_user_turns), tok,
                             ToolSet([]), max_response_length=512,
                             environment=lambda: InteractionEnvironment(interactions))
        trajs, metrics = runner.run([(p, extra, f"data.jsonl:{i + 1}", m) for i, (p, m) in enumerate(zip(ids, prompts))],
                                    SamplingParams(max_new_tokens=64), generate)
        return trajs, sessions

    trajs, sessions = run(0)
    for t, prompt in zip(trajs, prompts):
        assert t.finish_reason == "stop" and t.tool_reward == 0.0  # veRL keeps turn scores out of the reward
        assert [turn.role for turn in t.turns] == ["assistant", "environment", "assistant"]
        reply = t.turns[1]
        assert set(t.sampled[reply.start:reply.end]) == {0}  # the interaction's message: context
        assert "Your response is incorrect!" in tok.decode(t.response_ids[reply.start:reply.end])
    first = [m for m in seen if m[0]["content"] == prompts[0][0]["content"]]
    assert [m[-1] for m in first] == [{"role": "assistant", "content": "It is 72."},
                                      {"role": "assistant", "content": "#### 72"}]
    assert first[1][:3] == prompts[0] + [{"role": "assistant", "content": "It is 72."},
                                          {"role": "user", "content": "Your response is incorrect! You need to "
                                                                      "reflect on your answer and try again."}]
    keys = [k for call in sessions for k in call]
    assert len(keys) == 4 and len(set(keys)) == 2  # two trajectories x two turns: one session each

    trajs, _ = run(1)  # one user turn, then the episode ends before asking the interaction again
    assert [t.finish_reason for t in trajs] == ["max_turns", "max_turns"] and len(seen) == 2
