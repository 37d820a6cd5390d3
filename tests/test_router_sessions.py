"""Sticky sessions: the turns of a multi-turn trajectory go to one engine, whose prefix cache holds their shared
context. Through SGLang's router (sglang-router's `manual` policy and its `x-smg-routing-key` header), and in the
rollout group's own chunking when there is no router (a stable hash of the session picks the engine).

Which engine answered is read from the answer itself: the two CPU servers hold different weights, so the
greedy log-prob of one fixed prompt names the server."""

from __future__ import annotations

import collections

import pytest

from mgrpo.cluster.routes import session_engine
from mgrpo.rollout.types import GenerateRequest, SamplingParams
from tests.helpers.sglang_cpu import launch, tiny_checkpoint


def test_a_sessions_engine_is_a_stable_hash_spread_over_the_engines():
    assert session_engine("a", 7) == 0xE8B7BE43 % 7  # zlib's CRC-32 of b"a": the same in every process
    counts = collections.Counter(session_engine(f"traj-{i}", 4) for i in range(4000))
    assert sorted(counts) == [0, 1, 2, 3] and min(counts.values()) > 900


@pytest.mark.integration
def test_router_keeps_each_session_on_one_engine_and_spreads_sessions(tmp_path):
    pytest.importorskip("sglang_router")
    from mgrpo.rollout.sglang.router import RoutedClient

    a = launch(tiny_checkpoint(str(tmp_path / "a"), seed=1), str(tmp_path / "la"))
    b = launch(tiny_checkpoint(str(tmp_path / "b"), seed=2), str(tmp_path / "lb"))
    front = None
    try:
        greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
        prompt = [1, 2, 3]
        la = a.generate([GenerateRequest(0, prompt)], greedy)[0].logprobs[0]
        lb = b.generate([GenerateRequest(0, prompt)], greedy)[0].logprobs[0]
        assert abs(la - lb) > 1e-2  # different weights: the log-prob tells the servers apart (batching moves
        # it by float rounding only, ~1e-7)

        def name(lp: float) -> str:
            assert min(abs(lp - la), abs(lp - lb)) < 1e-4, (lp, la, lb)
            return "a" if abs(lp - la) < abs(lp - lb) else "b"
        front = RoutedClient([a.url, b.url], host="127.0.0.1", log_dir=str(tmp_path / "router"), policy="manual")
        served = collections.defaultdict(set)
        for turn in range(4):  # four turns of eight trajectories, each turn a batch through the router
            out = front.generate([GenerateRequest(i, prompt, session=f"traj-{i}") for i in range(8)], greedy)
            for i, r in enumerate(out):
                served[f"traj-{i}"].add(name(r.logprobs[0]))
        assert all(len(s) == 1 for s in served.values()), dict(served)  # every turn of a trajectory: one engine
        # min_group ("worker with fewest routing keys") spreads new sessions but not exactly in sglang-router
        # 0.3.2: CI's run gave 5 and 3, and so did two of five runs here with the first turn sent one request at a
        # time (traj-0 and traj-1 both to one engine). Both engines serve sessions; the split is not pinned.
        per_engine = collections.Counter(next(iter(s)) for s in served.values())
        assert sorted(per_engine) == ["a", "b"] and min(per_engine.values()) >= 2, per_engine
    finally:
        if front is not None:
            front.shutdown()
        a.shutdown()
        b.shutdown()
