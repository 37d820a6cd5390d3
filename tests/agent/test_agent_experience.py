"""Multi-turn trajectories into the experience (mgrpo/agent/ with the experience maker and the trainer's batch path):
failed samples keep their place out of the loss and their group's baseline, veRL's rollout.over_sample_rate cuts
the long tail (aborted, counted, never in a group), and a ready multi-turn batch survives the checkpoint.
tests/agent/test_agent.py holds the runner's own unit tests."""

from __future__ import annotations

import time

import pytest

from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.tools import FunctionTool, ToolSet
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.rollout.types import GenerateResult, SamplingParams
from tests.helpers.agent import ScriptedPolicy, add, slow_tool, call_text as _call, tool_prompts as _prompts


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    from mgrpo.data.tokenizer import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


# --- into the experience: failed samples stay in place, out of the loss and their group's baseline ---------
def _maker_run(qwen3, tmp_digits: list[list], *, min_group_size: int = 2, **mt):
    """Two prompts, n=3 each, through the experience maker: sample j of prompt i first calls `add` with
    a=digits[i][j] (or the hanging tool where the digit is None), then answers the tool's reply; the judge
    (flaky_digit_reward) scores an answer d as d/10. Judged; returns the experience and both metric dicts."""
    import dataclasses
    import re
    import threading
    from types import SimpleNamespace

    from mgrpo.components.experience_maker import ExperienceMaker, judge_experience
    from mgrpo.config import MGRPOConfig
    from mgrpo.data.dataset import PromptItem
    from mgrpo.rewards import Rules

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
                                  enable=True, function_tools=["x:y"], tool_timeout_s=0.5, trajectory_retries=0, **mt)))
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
                            tools=tools, rubric=None)
    try:
        exp, measured = maker.generate(items, 3, SamplingParams(max_new_tokens=256))
    finally:
        release.set()
    with Rules(cfg.reward) as judger:
        judged = judge_experience(judger, exp, qwen3, cfg)
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


# --- veRL's rollout.over_sample_rate: the long tail is cut, aborted, counted, never in a group -------------
def test_over_sample_rate_aborts_the_slowest_trajectories(qwen3):
    """veRL's rule: with N=10 and rate 0.2 the step ends when int(10 x 0.8) = 8 trajectories have finished; the two
    waiting on a 20 s tool end as 'aborted' at once, the engines' abort is asked once, and nothing is waited for."""
    tools = ToolSet([FunctionTool(slow_tool(20.0)), FunctionTool(add)])
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
    from mgrpo.components.experience_maker import judge_experience
    from mgrpo.experience import Experience
    from mgrpo.rewards import Rules

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
    with Rules(cfg.reward) as judger:
        got = judge_experience(judger, exp, qwen3, cfg)
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
