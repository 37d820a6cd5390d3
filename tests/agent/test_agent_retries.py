"""rollout.multi_turn.trajectory_retries: a trajectory whose tool hung or whose environment crashed is generated
again from its prompt with the same per-turn seeds. On the peek task with a random tiny model in the in-process
engine (real sampling, the grammar writing the call): a fault that fires once gives exactly the trajectories of
the run without it; one that always fires ends tool_timeout after the retries, each counted."""

from __future__ import annotations

import pytest
import torch

from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.tools import ToolSet
from mgrpo.config.multi_turn import MultiTurnConfig
from mgrpo.data.printable import VOCAB, printable_tokenizer
from mgrpo.heap import trim_heap
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers.chaos_tools import FAULTS_ENV, PeekEnvironment

trim_heap()  # finding libc runs ldconfig once: here, not inside a test
K = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from mgrpo.rollout.hf_engine import HFRolloutEngine
    from tests.helpers.convert import make_hf_checkpoint, tiny_cfg

    tok = printable_tokenizer()
    hf_dir = make_hf_checkpoint(str(tmp_path_factory.mktemp("hf")),
                                tiny_cfg(vocab_size=len(VOCAB), max_position_embeddings=512))
    engine = HFRolloutEngine(hf_dir, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                             tokenizer="printable")
    tools = ToolSet.from_config([], "tests/helpers/chaos_tools.yaml")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a decode step of a tiny model is all overhead: two threads on a loaded machine, 20x
    prompts = []
    for i in range(K):
        text = tok.apply_chat_template([{"role": "user", "content": f"Hidden digit {i}?"}],
                                       tools=tools.schemas(["peek"]), tokenize=False, add_generation_prompt=True)
        prompts.append((tok(text, add_special_tokens=False)["input_ids"],
                        {"tools_kwargs": {"peek": {"create_kwargs": {"secret": i + 3}}}}, f"record {i}"))
    yield tok, engine, tools, prompts
    torch.set_num_threads(threads)


def _run(setup, retries: int, tool_timeout_s: float = 0.5):
    tok, engine, tools, prompts = setup
    cfg = MultiTurnConfig(enable=True, tool_config_path="tests/helpers/chaos_tools.yaml", tool_choice="required",
                          stop_after_call=True, max_assistant_turns=2, max_tokens_per_turn=60,
                          tool_timeout_s=tool_timeout_s, trajectory_retries=retries)
    runner = AgentRunner(cfg, tok, tools, max_response_length=200, environment=PeekEnvironment)
    calls = []

    def generate(batch, sampling, sessions=None, seeds=None):
        calls.append(len(batch))
        reqs = [GenerateRequest(uid=i, prompt_ids=p, seed=s) for i, (p, s) in enumerate(zip(batch, seeds))]
        return engine.generate(reqs, sampling), {}

    trajs, metrics = runner.run(prompts, SamplingParams(temperature=1.0, max_new_tokens=200, seed=11), generate)
    return trajs, metrics, calls


def _same(a, b) -> float:
    """Asserts the same tokens, masks and turns; returns the max log-prob difference (a turn made in another
    batch: the engine's logits differ in their last bits, benchmarks/results/batch_invariance_cpu.json)."""
    assert [t.response_ids for t in a] == [t.response_ids for t in b]
    assert [t.sampled for t in a] == [t.sampled for t in b]
    assert [t.finish_reason for t in a] == [t.finish_reason for t in b]
    return max(abs(x - y) for ta, tb in zip(a, b) for x, y in zip(ta.logprobs, tb.logprobs))


@pytest.mark.parametrize("fault", ["tool_hang", "env_crash"])
def test_a_fault_that_fires_once_is_healed_into_the_fault_free_trajectory(setup, fault, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, str(tmp_path))
    clean, m0, _ = _run(setup, retries=1)
    # every trajectory called the tool (the grammar wrote the call) and answered; a random answer may run out
    # of budget ('length'), and only an answer that ended ('stop') is given to the environment
    assert all(t.finish_reason in ("stop", "length") and t.counts["multi_turn/tool_calls"] == 1 for t in clean)
    assert "stop" in [t.finish_reason for t in clean] and "multi_turn/trajectory_retries" not in m0
    (tmp_path / fault).write_text("1")
    healed, m1, calls = _run(setup, retries=1)
    assert not (tmp_path / fault).exists()  # the fault fired
    assert _same(healed, clean) <= 1e-6
    reason = {"tool_hang": "tool_timeout", "env_crash": "env_failed"}[fault]
    assert m1["multi_turn/trajectory_retries"] == 1 and m1[f"multi_turn/trajectory_retries/{reason}"] == 1
    assert m1["multi_turn/failed"] == 0
    # the fault itself stays counted; the dropped attempt's turns do not
    assert m1.get({"tool_hang": "multi_turn/tool_timeouts", "env_crash": "multi_turn/env_errors"}[fault]) == 1
    assert m1["multi_turn/tool_calls"] == m0["multi_turn/tool_calls"] == K
    assert sum(calls) == 2 * K + {"tool_hang": 1, "env_crash": 2}[fault]  # the retried trajectory's turns again
    assert sum(calls) > len(calls)  # several turns shared a call: a retried one was sent in other batches


def test_a_tool_that_always_hangs_ends_tool_timeout_after_the_retries(setup, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, str(tmp_path))
    (tmp_path / "tool_hang").write_text(str(10 ** 6))
    trajs, m, _ = _run(setup, retries=2, tool_timeout_s=0.2)
    assert [t.finish_reason for t in trajs] == ["tool_timeout"] * K and all(t.failed for t in trajs)
    assert m["multi_turn/trajectory_retries"] == 2 * K and m["multi_turn/trajectory_retries/tool_timeout"] == 2 * K
    assert m["multi_turn/tool_timeouts"] == 3 * K and m["multi_turn/failed"] == K
    # and with retries off it fails at once, as before
    trajs, m, _ = _run(setup, retries=0, tool_timeout_s=0.2)
    assert m["multi_turn/tool_timeouts"] == K and "multi_turn/trajectory_retries" not in m


def test_negative_retries_are_refused_naming_the_key():
    from mgrpo.config.checks import multi_turn_errors

    cfg = MultiTurnConfig(enable=True, tool_config_path="tests/helpers/chaos_tools.yaml", trajectory_retries=-1)
    errors = multi_turn_errors(cfg, "printable")
    assert [e for e in errors if e.startswith("rollout.multi_turn.trajectory_retries=-1 must be >= 0")], errors
    assert not multi_turn_errors(MultiTurnConfig(enable=True, tool_config_path="tests/helpers/chaos_tools.yaml"),
                                 "printable")
