"""Routing replay (actor.router_replay): the routes ride with their tokens through every micro-batch layout,
megatron's RouterReplay replays and records them per model, the counts behind actor/router/agreement and
the per-layer imbalance, the config checks, and the experience carrying the routes compactly.

The multi-rank parity of replay (EP=2, TP2xEP2, CP2xEP2, padded, PP2 with full recompute against one rank)
is tests/training/test_router_replay_parallel.py; the engines' routes and the whole loop are
tests/e2e/test_router_replay_e2e.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mgrpo.training.batch import RankBatch, batch_layout, build_micro_batch
from mgrpo.training.rank_batch import compact_routes
from mgrpo.training.router_replay import router_order

LENS = [(3, 4), (5, 1), (2, 7), (6, 3)]  # (prompt, response)


def _batch(top_k: int = 2) -> RankBatch:
    """Token ids name their sample and position (100 s + p); the route of a position is (id, id + 1, ...)."""
    ids = [[100 * s + p for p in range(a + b)] for s, (a, b) in enumerate(LENS)]
    routes = [np.stack([np.array([[t + j for j in range(top_k)]] * 3) for t in x[:-1]]) for x in ids]
    return RankBatch(input_ids=ids, prompt_lens=[a for a, _ in LENS], seq_index=list(range(len(LENS))),
                     routed_experts=routes)


def _targets(mb, sp: int, sp_rank: int, layer: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the routers of this rank replay, as `ModelRouting.begin` builds it, with the tokens they see."""
    from mgrpo.training.router_replay import default_route

    rows = router_order(mb.route_rows, sp, sp_rank)
    valid = rows >= 0
    target = default_route(rows.numel(), mb.routes.shape[2])
    target[valid] = mb.routes[rows[valid], layer].long()
    return target, valid, router_order(mb.tokens, sp, sp_rank)


@pytest.mark.parametrize("packed,cp,sp", [(False, 1, 1), (True, 1, 1), (False, 2, 1), (True, 2, 1), (False, 1, 2),
                                          (True, 1, 2), (True, 2, 2), (False, 2, 2)])
def test_routes_follow_their_tokens(packed, cp, sp):
    """Whatever the layout (padded rows transposed to megatron's [s, b], THD packs, CP chunks, the
    sequence-parallel split), every router slot replays the route of the token it holds; every position but a
    sample's last is routed exactly once over the CP and SP ranks; the rest gets experts 0..k-1."""
    batch = _batch()
    seen = []
    for cp_rank in range(cp):
        mb = build_micro_batch(batch, batch_layout(packed=packed, cp=cp, cp_rank=cp_rank, sp=sp))
        for sp_rank in range(sp):
            target, valid, tokens = _targets(mb, sp, sp_rank)
            assert torch.equal(target[valid], torch.stack([tokens[valid], tokens[valid] + 1], dim=1))
            assert torch.equal(target[~valid], torch.tensor([[0, 1]]).expand(int((~valid).sum()), 2))
            seen += tokens[valid].tolist()
    want = [100 * s + p for s, (a, b) in enumerate(LENS) for p in range(a + b - 1)]
    assert sorted(seen) == want


def test_router_order_is_sequence_major_and_split_over_sequence_parallel_ranks():
    x = torch.arange(12).view(2, 6)  # [b=2, s=6]: row r holds 6r .. 6r+5
    assert router_order(x).tolist() == [0, 6, 1, 7, 2, 8, 3, 9, 4, 10, 5, 11]
    assert router_order(x, sp=2, sp_rank=1).tolist() == [3, 9, 4, 10, 5, 11]


def test_bad_routes_are_refused_by_sample():
    batch = _batch()
    batch.routed_experts[2] = batch.routed_experts[2][:-1]
    with pytest.raises(ValueError, match=r"sample 2: routed experts of shape \(7, 3, 2\) for 9 tokens"):
        build_micro_batch(batch)


def test_compact_routes():
    assert compact_routes(np.array([[[0, 255]]])).dtype == np.uint8
    assert compact_routes(np.array([[[0, 256]]])).dtype == np.int16
    assert compact_routes(np.array([[[0, 40000]]])).dtype == np.int32
    with pytest.raises(ValueError, match="negative expert id"):
        compact_routes(np.array([[[-1, 2]]]))


# ---------------------------------------------------------------------------------------------
# LayerReplay: megatron's RouterReplay, owned per model, counting


def _route(replay, logits, k=2):
    """megatron's own top-k routing (the router's call), through `replay`."""
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    return topk_routing_with_score_function(logits, k, score_function="softmax", router_replay=replay)


def test_layer_replay_replays_and_counts_agreement_and_load():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from mgrpo.training.router_replay import LayerReplay

    before = list(RouterReplay.global_router_replay_instances)
    replay = LayerReplay(num_experts=4)
    assert RouterReplay.global_router_replay_instances == before  # not in the process-wide list
    logits = torch.tensor([[4.0, 3.0, 0.0, 0.0],   # own choice {0, 1}
                           [0.0, 0.0, 2.0, 5.0],   # {2, 3}
                           [1.0, 0.0, 3.0, 0.5],   # {0, 2}
                           [9.0, 0.0, 0.0, 8.0]])  # {0, 3}  (padding)
    target = torch.tensor([[1, 0], [3, 1], [2, 0], [1, 2]])  # same set, other, same, (padding)
    replay.measure = True
    replay.real = torch.tensor([True, True, True, False])
    replay.valid = torch.tensor([True, True, False, False])  # row 2: no rollout route (a last token)
    replay.set_target_indices(target)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, routing_map = _route(replay, logits)
    assert routing_map.tolist() == [[True, True, False, False], [False, True, False, True],
                                    [True, False, True, False], [False, True, True, False]]
    # the weights are the router's own logits at the replayed experts (softmax over the top-k logits)
    assert probs[1, 3].item() == pytest.approx(torch.softmax(torch.tensor([5.0, 0.0]), 0)[0].item())
    assert (replay.agree, replay.checked) == (1, 2)
    assert replay.load.tolist() == [2.0, 2.0, 1.0, 1.0]  # the replayed experts of the 3 real tokens
    # a recompute in backward pops the next target and is not counted again
    replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    _, again = _route(replay, logits)
    assert torch.equal(again, routing_map) and replay.replay_backward_list == []
    assert (replay.agree, replay.checked) == (1, 2)
    # recording keeps the router's own choice and counts its load
    replay.reset_counts()
    replay.set_router_replay_action(RouterReplayAction.RECORD)
    _route(replay, logits)
    assert replay.get_recorded_indices().sort(dim=1).values.tolist() == [[0, 1], [2, 3], [0, 2], [0, 3]]
    assert replay.load.tolist() == [2.0, 1.0, 2.0, 1.0] and replay.checked == 0


def test_layer_replay_refuses_masks_of_another_length():
    from mgrpo.training.router_replay import LayerReplay

    replay = LayerReplay(num_experts=4)
    replay.measure, replay.real, replay.valid = True, torch.ones(3, dtype=torch.bool), torch.ones(3, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="token order out of step"):
        _route(replay, torch.randn(4, 4))


def test_megatron_router_replay_premise():
    """What ModelRouting builds on (megatron-core 0.16.1): the router asks its RouterReplay for the top-k with
    (scores, topk, num_groups, group_topk, default_compute_topk), and REPLAY_BACKWARD pops targets in order."""
    import inspect

    from megatron.core.transformer.moe import moe_utils, router
    from megatron.core.transformer.moe.router_replay import RouterReplay

    assert list(inspect.signature(RouterReplay.get_replay_topk).parameters) == [
        "self", "scores", "topk", "num_groups", "group_topk", "default_compute_topk"]
    assert "router_replay.get_replay_topk(" in inspect.getsource(moe_utils.topk_routing_with_score_function)
    assert "self.router_replay = RouterReplay()" in inspect.getsource(router.TopKRouter.__init__)
    assert "self.replay_backward_list.pop(0)" in inspect.getsource(RouterReplay.get_replay_topk)


# ---------------------------------------------------------------------------------------------
# config


def _moe_config(**actor):
    from mgrpo_launchers.plan import compose_config

    cfg = compose_config(["model=tiny-moe"])
    return dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, **actor))


def test_router_replay_config_checks(monkeypatch):
    from mgrpo.config import ConfigError, MGRPOConfig
    from mgrpo.preflight import preflight
    from mgrpo.rollout import factory

    for mode in ("off", "rollout", "old"):
        preflight(_moe_config(router_replay=mode), check_memory=False)
    dense = MGRPOConfig()
    with pytest.raises(ConfigError, match="actor.router_replay='old' replays mixture-of-experts routing, but "
                                          "model.family='qwen3' has no experts"):
        preflight(dataclasses.replace(dense, actor=dataclasses.replace(dense.actor, router_replay="old")),
                  check_memory=False)
    with pytest.raises(ConfigError, match=r"actor.router_replay='R3' is not one of \['off', 'rollout', 'old'\]"):
        preflight(_moe_config(router_replay="R3"), check_memory=False)
    # an engine that does not return routes cannot feed actor.router_replay=rollout
    monkeypatch.setitem(factory.ENGINES, "hf", dataclasses.replace(factory.ENGINES["hf"], returns_routes=False))
    cfg = _moe_config(router_replay="rollout")
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine="hf"))
    with pytest.raises(ConfigError, match="rollout.engine=hf does not return them"):
        preflight(cfg, check_memory=False)
    preflight(dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, router_replay="old")), check_memory=False)


def test_rollout_requests_ask_for_routes_and_sglang_is_launched_for_them():
    from mgrpo.components.experience_maker import ExperienceMaker
    from mgrpo.rollout.factory import EngineContext, _hf_kwargs, _sglang_kwargs

    ctx = EngineContext(eos_token_ids=[1], pad_token_id=0)
    for mode, want in (("off", False), ("old", False), ("rollout", True)):
        cfg = _moe_config(router_replay=mode)
        maker = ExperienceMaker(cfg, tokenizer=None, train_data=None, rubric=None, rollout=None)
        assert maker.sampling(0).return_routed_experts is want
        assert _sglang_kwargs(cfg, ctx)["return_routed_experts"] is want
        assert _hf_kwargs(cfg, ctx)["return_routed_experts"] is want


def test_old_replay_forces_the_old_policy_forward():
    from mgrpo.components.actor_client import ActorClient
    from mgrpo.experience import Experience

    exp = Experience([[1]] * 2, [[2]] * 2, [[0.0]] * 2, ["stop"] * 2, [0] * 2, [0, 0])
    assert not ActorClient(None, _moe_config(router_replay="rollout"), 1).needs_old_logprobs(exp)
    assert ActorClient(None, _moe_config(router_replay="old"), 1).needs_old_logprobs(exp)


# ---------------------------------------------------------------------------------------------
# the experience carries the routes


def test_experience_carries_routes_compactly_and_shards_them_with_their_samples():
    from mgrpo.components.actor_client import ActorClient
    from mgrpo.components.rollout_pipeline import experience_from_json, experience_to_json
    from mgrpo.data.dataset import PromptItem
    from mgrpo.experience import Experience
    from mgrpo.rollout.types import GenerateResult

    items = [PromptItem(index=i, prompt_ids=[1] * (2 + i), prompt_text="", data_source="sum", ground_truth="0")
             for i in range(3)]
    results = [GenerateResult(uid=i, token_ids=[5] * (1 + i), logprobs=[-1.0] * (1 + i), finish_reason="stop",
                              weight_version=0,
                              routed_experts=np.full(((2 + i // 2) + (1 + i) - 1, 2, 2), i, dtype=np.int32))
               for i in range(6)]
    exp = Experience.from_rollout(items, results, n=2)
    assert all(r.dtype == np.uint8 for r in exp.routed_experts)
    back = experience_from_json(experience_to_json(exp), items)  # an asynchronous batch saved with a checkpoint
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(back.routed_experts, exp.routed_experts))
    joined = Experience.concat([exp.select([4, 5]), exp.select([0])])
    assert [int(r[0, 0, 0]) for r in joined.routed_experts] == [4, 5, 0]
    cfg = _moe_config(router_replay="rollout")
    shards = ActorClient(None, cfg, dp=2)._shards(exp, range(len(exp)), for_training=False)
    for shard in shards:
        for i, ids, routes in zip(shard.seq_index, shard.input_ids, shard.routed_experts):
            assert routes.shape[0] == len(ids) - 1 and int(routes[0, 0, 0]) == i
    partial = [dataclasses.replace(r, routed_experts=None) if r.uid == 3 else r for r in results]
    with pytest.raises(RuntimeError, match="1 of 6 rollout results came back without routed_experts"):
        Experience.from_rollout(items, partial, n=2)


def test_verl_router_replay_modes():
    """veRL's actor_rollout_ref.actor.router_replay.mode: disabled | R2 | R3 -> actor.router_replay."""
    from mgrpo.compat.verl import VerlKeyError, translate
    from mgrpo_launchers.plan import compose_config

    for mode, want in (("disabled", "off"), ("R2", "old"), ("R3", "rollout")):
        t = translate(["model=tiny-moe", f"actor_rollout_ref.actor.router_replay.mode={mode}",
                       f"actor_rollout_ref.ref.router_replay.mode={mode}",
                       "actor_rollout_ref.rollout.enable_rollout_routing_replay=" + str(mode == "R3")])
        assert compose_config(t.args).actor.router_replay == want
    with pytest.raises(VerlKeyError, match="router_replay.mode is disabled | R2 | R3"):
        translate(["actor_rollout_ref.actor.router_replay.mode=R4"])
