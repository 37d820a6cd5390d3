"""Multi-turn samples through the trainer's other layouts: one step of the peek task on the tiny model, its first
call constrained (tool_choice=required: the grammar's tokens are context too), with an environment that always
replies (so every trajectory holds a context span and a turn after it), and the
engine's and the trainer's log-probs compared token by token on every sampled token, also those after a
context span. A layout that scored context tokens, or shifted the ids the engine continued from, would differ
there by far more than 1e-5 (tests/e2e/test_agent_e2e.py does TP=2 with packing).

- CP=2 with packing: each sequence is split over two ranks and gathered back in sample order;
- PP=2: two pipeline stages, the log-probs from the last one;
- logprob_support=sampled (top_k=5) at TP=2: behaviour log-probs over each sampled token's support, which
  the trajectories carry turn by turn (without them the trainer normalised over the whole vocabulary: the
  difference was 2.54 nat);
- routing replay from the rollout (R3) on the tiny MoE at EP=2 and TP=2 x EP=2 with packing: the routes the
  runner assembled over the turns are replayed (replaying the default route on the context positions instead,
  as a check that this test can fail: log-prob difference 0.126, router agreement 0.77, at EP=2)."""

from __future__ import annotations

import dataclasses

import pytest

from mgrpo.config import MGRPOConfig
from mgrpo.data.printable import VOCAB
from mgrpo.loop import Trainer
from tests.helpers.runs import read_metrics, trajectories

pytestmark = pytest.mark.integration


def _config(run_dir: str, actor: dict, rollout: dict, algorithm: dict) -> MGRPOConfig:
    cfg = MGRPOConfig()
    r = cfg.rollout
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, tokenizer="printable", vocab_size=len(VOCAB), max_position_embeddings=512),
        data=dataclasses.replace(cfg.data, synthetic_task="peek", max_prompt_length=256, max_response_length=224,
                                 train_batch_size=8),
        algorithm=dataclasses.replace(cfg.algorithm, use_kl_loss=False, **algorithm),
        actor=dataclasses.replace(cfg.actor, **actor),
        rollout=dataclasses.replace(r, engine="hf", mode="hybrid", n=4, **rollout, multi_turn=dataclasses.replace(
            r.multi_turn, enable=True, tool_config_path="configs/tools/peek.yaml", max_assistant_turns=3,
            max_tokens_per_turn=48, environment="tests.helpers.agent:AlwaysReply", tool_choice="required",
            stop_after_call=True)),
        trainer=dataclasses.replace(cfg.trainer, output_dir=run_dir, device="cpu", total_training_steps=1,
                                    logger=["tensorboard"], save_hf=False, log_token_logprobs=True),
    )


@pytest.mark.parametrize("actor,rollout,algorithm", [
    ({"cp": 2, "pack_sequences": True}, {}, {}),
    ({"pp": 2}, {}, {}),
    ({"tp": 2}, {"top_k": 5}, {"logprob_support": "sampled"}),
], ids=["cp2-packed", "pp2", "tp2-sampled-support"])
def test_multi_turn_step1_logprobs_match_in_other_layouts(tmp_path, actor, rollout, algorithm):
    Trainer(_config(str(tmp_path), actor, rollout, algorithm)).fit()
    (m,) = read_metrics(str(tmp_path))
    assert m["rollout/logprob_abs_diff_max"] <= 1e-5
    after_context = 0
    for row in trajectories(str(tmp_path)):
        mask = row["sampled_mask"]
        assert len(mask) == len(row["response_ids"]) == len(row["rollout_logprobs"]) == len(row["trainer_logprobs"])
        first_context = mask.index(0) if 0 in mask else len(mask)
        for k in range(first_context, len(mask)):
            if mask[k]:
                after_context += 1
                assert abs(row["rollout_logprobs"][k] - row["trainer_logprobs"][k]) <= 1e-5, (row["multi_turn"], k)
    assert after_context > 0 and m["multi_turn/context_tokens"] > 0


@pytest.mark.parametrize("layout", [{"ep": 2}, {"tp": 2, "ep": 2}], ids=["ep2", "tp2ep2"])
def test_multi_turn_replays_the_engines_routes(tmp_path, monkeypatch, layout):
    """Routing replay from the rollout (actor.router_replay=rollout, R3) on multi-turn samples: the tiny MoE at
    EP=2, and at TP=2 x EP=2 (experts split over the tensor-parallel ranks, tokens dispatched between them), with
    packing, the in-process engine returning each turn's routes from the first position its trajectory has no
    route for (routed_experts_start_len), the runner assembling them over the turns (mgrpo/agent/turn_routes.py).
    Every position's assembled route equals the routers' top-k recomputed by a plain transformers forward over
    the whole trajectory (tests/helpers/moe.py::recomputed_routes), each row came over once, the trainer's
    routers would have chosen the replayed experts at every routed position (agreement 1.0), and engine and
    trainer log-probs agree within 1e-5 on every sampled token, also after a context span (whose routes came
    from the next turn's prefill)."""
    import numpy as np

    from mgrpo.experience import Experience
    from tests.helpers.moe import recomputed_routes, tiny_moe

    made = []
    build = Experience.from_trajectories.__func__

    def keep(cls, *args, **kw):
        made.append(build(cls, *args, **kw))
        return made[-1]

    monkeypatch.setattr(Experience, "from_trajectories", classmethod(keep))
    cfg = _config(str(tmp_path), {**layout, "router_replay": "rollout", "pack_sequences": True}, {}, {})
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **tiny_moe(router_aux_loss_coef=0.001)),
                              data=dataclasses.replace(cfg.data, train_batch_size=4))
    Trainer(cfg).fit()
    (m,) = read_metrics(str(tmp_path))
    assert m["rollout/logprob_abs_diff_max"] <= 1e-5
    assert m["actor/router/agreement"] == 1.0
    assert m["multi_turn/unrouted_positions"] == 0 and "multi_turn/route_rows_recomputed_differ" not in m
    (exp,) = made
    # every row came over once: one per position, and those of tokens cut after a call (stop_after_call)
    assert m["multi_turn/route_rows_received"] == m.get("multi_turn/tokens_cut_after_call", 0) + sum(
        len(p) + len(r) - 1 for p, r in zip(exp.prompt_ids, exp.response_ids))
    init = str(tmp_path / "init_hf")
    spans = 0
    for prompt, response, mask, routes in zip(exp.prompt_ids, exp.response_ids, exp.sampled_mask, exp.routed_experts):
        seq = list(prompt) + list(response)
        assert routes.shape[0] == len(seq) - 1
        np.testing.assert_array_equal(np.sort(routes, -1), np.sort(recomputed_routes(init, seq[:-1]), -1))
        spans += any(a == 0 and b == 1 for a, b in zip(mask, mask[1:]))  # a sampled turn after a context span
    assert spans > 0 and m["multi_turn/context_tokens"] > 0
