"""Routing replay on the real MegatronActor (megatron-core over gloo, the alltoall dispatcher): every layout
replays and records the same routes as one rank.

Per layout, on tests/training/test_moe_parallel.py's checkpoint and batch:
  - actor.router_replay=old's recording forward returns, per sample, the experts the routers chose: equal to
    the one-rank run's (ids, exactly), and replaying them reproduces the plain log-probs (a route that went
    to the wrong token under some layout would change them);
  - replaying other routes (random experts) changes the log-probs, and the actor's log-probs, the
    reference's (the same initial weights, its own routers given the same targets), the update's losses
    and gradient norm and the log-probs after it equal the one-rank run's within 1e-5; the agreement and
    the per-layer imbalance, counted over all ranks, equal the one-rank run's exactly.
Layouts: EP=2, TP2xEP2 (sequence parallel), CP2xEP2, padded TP2xEP2 ([s, b] order split over the TP
ranks), padded one rank, and PP=2 with full recompute over several micro-batches (1F1B runs forwards
ahead of backwards: the recompute must pop the targets of its own micro-batch).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tests.helpers.distributed import run_ranks
from tests.helpers.moe import AUX, moe_cfg, run_config
from tests.helpers.packing import PROMPTS, RESPONSES, make_batch, max_diff

pytestmark = pytest.mark.integration

KEYS = ("actor/loss", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl",
        "actor/moe_load_balancing_loss")


def random_routes(cfg, seed: int = 5) -> list[np.ndarray]:
    """Per sample of make_batch, [length - 1, layers, k] distinct random experts."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in zip(PROMPTS, RESPONSES):
        scores = torch.rand(p + r - 1, cfg.num_layers, cfg.num_experts, generator=g)
        out.append(scores.argsort(dim=-1)[..., :cfg.moe_router_topk].numpy().astype(np.uint8))
    return out


def _one_run(rank, world, port, hf_dir, layout: dict, routes: list):
    from mgrpo.training.actor import MegatronActor

    layout = dict(layout)
    recompute, aux = layout.pop("recompute", None), layout.pop("aux", AUX)
    cfg = run_config(aux=aux, **layout)
    cfg = dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, recompute=recompute, router_replay="old"))
    actor = MegatronActor(cfg, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                          init_hf_dir=hf_dir, total_steps=1, need_ref=True)
    c = actor.ctx
    mine = [i for i in range(len(PROMPTS)) if i % c.dp == c.dp_rank]
    batch = make_batch(cfg.model.vocab_size).select(mine)
    recorded = actor.compute_logprobs(batch, "actor")  # router_replay=old: the routers' own choice
    with_routes = dataclasses.replace(batch, routed_experts=[routes["own"][i] for i in mine])
    own = actor.compute_logprobs(with_routes, "actor")
    other = dataclasses.replace(batch, routed_experts=[routes["random"][i] for i in mine])
    before = actor.compute_logprobs(other, "actor")
    ref = actor.compute_logprobs(other, "ref")
    metrics = actor.train_mini_batch(other)
    after = actor.compute_logprobs(other, "actor")
    leftover = sum(len(r.replay_backward_list) + (r.target_topk_idx is not None)
                   for routing in (actor.routing, actor.ref_routing) for _, r in routing.layers)
    return dict(info=actor.info(), samples=mine, recorded=recorded, own=own, before=before, ref=ref, after=after,
                metrics=metrics, leftover=leftover, micro_batches=len(actor._micro_batches(batch)[0]))


def rank_runs(rank, world, port, hf_dir, layouts, routes):
    from megatron.core import parallel_state as ps

    out = []
    for layout in layouts:
        out.append(_one_run(rank, world, port, hf_dir, layout, routes))
        ps.destroy_model_parallel()
    return out


def merged(results: list[dict]) -> dict:
    """Per-sample results of every data-parallel replica in batch order."""
    n = len(PROMPTS)
    out: dict = {key: [None] * n for key in ("routes", "plain", "own", "before", "ref", "after")}
    for r in results:
        if r["recorded"] is None:
            continue
        for i, pos in enumerate(r["samples"]):
            out["routes"][pos] = r["recorded"]["routed_experts"][i]
            out["plain"][pos] = r["recorded"]["logprobs"][i]
            for key in ("own", "before", "ref", "after"):
                out[key][pos] = r[key]["logprobs"][i]
    assert all(v is not None for v in out["plain"])
    return dict(out, metrics=results[0]["metrics"], all_metrics=[r["metrics"] for r in results],
                leftover=sum(r["leftover"] for r in results), micro_batches=max(r["micro_batches"] for r in results))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from mgrpo.models import init_hf_checkpoint

    hf_dir = init_hf_checkpoint(str(tmp_path_factory.mktemp("replay") / "hf"), moe_cfg(), seed=3)
    cfg = moe_cfg()
    # the one-rank run records the routers' own choice first; every layout then replays it and random routes
    (first,) = run_ranks(rank_runs, 1, hf_dir, [{}], {"own": random_routes(cfg), "random": random_routes(cfg)},
                         timeout_s=600)[0]
    routes = {"own": first["recorded"]["routed_experts"], "random": random_routes(cfg)}
    one = run_ranks(rank_runs, 1, hf_dir, [{}, dict(packed=False), dict(aux=0.0)], routes, timeout_s=600)[0]
    # the load-balancing loss is per micro-batch and data-parallel replica (tests/training/test_moe_parallel.py):
    # layouts that split the batch otherwise run without it, against the one-rank run without it
    two = run_ranks(rank_runs, 2, hf_dir, [dict(ep=2, aux=0.0), dict(tp=2, ep=2), dict(cp=2, ep=2),
                                           dict(tp=2, ep=2, packed=False),
                                           dict(pp=2, recompute="full", budget=32, aux=0.0)],
                    routes, timeout_s=900)
    layouts = {"ep2": 0, "tp2ep2": 1, "cp2ep2": 2, "tp2ep2_padded": 3, "pp2_recompute": 4}
    out = {"one": merged([one[0]]), "padded": merged([one[1]]), "one_no_aux": merged([one[2]])}
    out.update({label: merged([r[k] for r in two]) for label, k in layouts.items()})
    return dict(out, routes=routes)


def test_one_rank_replays_its_own_routes_exactly_and_other_routes_change_the_log_probs(runs):
    one = runs["one"]
    assert max_diff(one["own"], one["plain"]) < 1e-6  # the routers' own choice, replayed
    assert max_diff(one["before"], one["plain"]) > 1e-2  # random experts: other outputs
    assert max_diff(one["ref"], one["before"]) < 1e-6  # the reference's routers followed the same targets
    assert runs["one"]["leftover"] == 0  # no targets or backward lists stay after any pass
    m = one["metrics"]
    assert 0.0 < m["actor/router/agreement"] < 0.6  # random routes: a few match the router's choice
    imbalance = [m[f"actor/router/imbalance/layer_{i}"] for i in range(moe_cfg().num_layers)]
    assert all(1.0 < x < moe_cfg().num_experts / 2 for x in imbalance)


@pytest.mark.parametrize("label", ["padded", "ep2", "tp2ep2", "cp2ep2", "tp2ep2_padded", "pp2_recompute"])
def test_layouts_replay_and_record_as_one_rank(runs, label):
    without_aux = label in ("ep2", "pp2_recompute")
    got, want = runs[label], runs["one_no_aux" if without_aux else "one"]
    for a, b in zip(got["routes"], want["routes"]):
        assert a.shape == b.shape and np.array_equal(np.sort(a, -1), np.sort(b, -1)), label
    assert max_diff(got["own"], got["plain"]) < 1e-6, label
    for key in ("plain", "before", "ref"):
        assert max_diff(got[key], want[key]) < 1e-5, (label, key)
    assert max_diff(got["after"], want["after"]) < 1e-4, label  # Adam's first step: see test_moe_parallel
    for k in KEYS[:-1] if without_aux else KEYS:
        a, b = got["metrics"][k], want["metrics"][k]
        assert math.isfinite(a) and abs(a - b) < 1e-5, (label, k, a, b)
    router_keys = [k for k in want["metrics"] if k.startswith("actor/router/")]
    assert len(router_keys) == 1 + 2 * moe_cfg().num_layers  # agreement: overall and per layer; imbalance
    for m in got["all_metrics"]:  # every rank reports the whole step's counts
        assert all(m[k] == want["metrics"][k] for k in router_keys), label
    assert got["leftover"] == 0, label
    if label == "pp2_recompute":
        assert got["micro_batches"] > 2
