"""Routing replay from the rollout (actor.router_replay=rollout, R3) with multi-turn trajectories: each position's
route comes from the turn whose forward first computed it (mgrpo/agent/turn_routes.py), assembled by the runner and
carried into the experience; a turn without routes refuses the batch. The runs with the in-process engine (EP=2,
TP=2 x EP=2) are tests/e2e/test_agent_layouts.py::test_multi_turn_replays_the_engines_routes."""

from __future__ import annotations

import numpy as np
import pytest

from mgrpo.agent.turn_routes import RoutesError, extend_routes, trajectory_routes
from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.tools import FunctionTool, ToolSet
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.rollout.types import SamplingParams
from tests.helpers.agent import ScriptedPolicy, add, call_text, tool_prompts

LAYERS, TOP_K, EXPERTS = 3, 2, 8


def _rows(rng: np.random.Generator, n: int) -> np.ndarray:
    """n routes of LAYERS x TOP_K distinct expert ids."""
    return np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(n * LAYERS)]).reshape(n, LAYERS, TOP_K) \
        .astype(np.int32)


def test_three_turns_assemble_each_position_from_the_forward_that_first_computed_it():
    """A hand-made trajectory: a 5-token prompt, then assistant (4 sampled) / tool reply (3 context) / assistant
    (2) / tool reply (2) / assistant (3). Turn k of P_k input ids and O_k outputs returns rows [0, P_k + O_k - 1).
    Each turn computes its new positions (its prefill of the previous turn's last sampled token and the context
    after it, then its own decode) with routes of its own, and returns earlier positions as a prefix cache keeps
    them, except for a few positions it 'computed again' differently (a cache miss with other rounding). The
    expected rows come from a per-position rule independent of the assembly's slicing: position p takes the
    first turn whose rows reach past p."""
    rng = np.random.default_rng(0)
    prompt, spans = 5, [(4, 3), (2, 2), (3, 0)]  # (sampled, context after) per turn
    fed, ends = [], []  # per turn: input ids, and positions it returns rows for
    n = prompt
    for sampled, context in spans:
        fed.append(n)
        ends.append(n + sampled - 1)
        n += sampled + context
    total = n
    computed = [_rows(rng, end) for end in ends]  # what turn k's forwards would route at every position
    recomputed_differently = {1: [2, 6], 2: [7]}  # turn -> earlier positions it routed otherwise
    turns = []
    for k, rows in enumerate(computed):
        got = rows.copy()
        if k:
            prev = ends[k - 1]
            got[:prev] = turns[k - 1][:prev]  # the prefix cache: the first computation's rows
            for p in recomputed_differently.get(k, []):
                got[p] = (got[p] + 1) % EXPERTS
        turns.append(got)

    known, differ = None, 0
    for k, (got, (sampled, _)) in enumerate(zip(turns, spans)):
        known, d = extend_routes(known, got, fed[k], sampled)
        differ += d
    # turn 1 differs at 2 and 6; turn 2 returns turn 1's rows there (its cache holds what turn 1 computed) and
    # differs at 7 too
    assert known.shape == (total - 1, LAYERS, TOP_K) and differ == 5
    want = np.stack([turns[next(k for k, e in enumerate(ends) if p < e)][p] for p in range(total - 1)])
    np.testing.assert_array_equal(known, want)
    # turn 0's last sampled token (position 8) and its tool reply (9..11) are routed by turn 1's prefill
    np.testing.assert_array_equal(known[8:12], computed[1][8:12])
    assert not np.array_equal(known[2], turns[1][2])  # the first computation is kept, not the recomputation

    # asking each turn only for the rows not known yet (SGLang's routed_experts_start_len = rows known) gives the
    # same routes with nothing to compare
    fresh, starts = None, []
    for k, (got, (sampled, _)) in enumerate(zip(turns, spans)):
        start = 0 if fresh is None else fresh.shape[0]
        starts.append(start)
        fresh, d = extend_routes(fresh, got[start:], fed[k], sampled, start)
        assert d == 0
    np.testing.assert_array_equal(fresh, known)
    assert starts == [0, ends[0], ends[1]]
    # from a position between: the overlap [start, n) is compared
    _, d = extend_routes(turns[0], turns[1][2:], fed[1], spans[1][0], 2)
    assert d == 2  # positions 2 and 6
    with pytest.raises(RoutesError, match=r"start at position 9, but earlier turns routed only 8"):
        extend_routes(turns[0], turns[1][9:], fed[1], spans[1][0], 9)
    with pytest.raises(RoutesError, match=r"expected \[5, layers, top_k\] from position 8"):
        extend_routes(turns[0], turns[1], fed[1], spans[1][0], 8)

    rows, unrouted = trajectory_routes(known, total, failed=False, shape=(LAYERS, TOP_K), uid=0)
    assert rows is known and unrouted == 0
    with pytest.raises(RoutesError, match=r"\[11, layers, top_k\]"):  # 5 + 4 - 1 = 8 rows, not 11
        extend_routes(None, computed[0], fed[0], 7)
    with pytest.raises(RoutesError, match="routed 8 of its 18 positions"):
        trajectory_routes(computed[0], total, failed=False, shape=(LAYERS, TOP_K), uid=3)


def test_a_failed_trajectorys_unfed_tail_gets_the_default_route_and_is_counted():
    rows, unrouted = trajectory_routes(np.full((4, LAYERS, TOP_K), 5, np.int32), 8, failed=True,
                                       shape=(LAYERS, TOP_K), uid=1)
    assert unrouted == 3 and rows.shape == (7, LAYERS, TOP_K)
    np.testing.assert_array_equal(rows[4:], np.broadcast_to([0, 1], (3, LAYERS, TOP_K)))
    rows, unrouted = trajectory_routes(None, 6, failed=True, shape=(LAYERS, TOP_K), uid=2)  # never generated
    assert unrouted == 5 and rows.shape == (5, LAYERS, TOP_K)


# --- through the runner and into the experience --------------------------------------------------------------
def _route_of(token: int, position: int) -> np.ndarray:
    """A deterministic 'router': what every forward routes position `position` holding `token` to."""
    first = (token * 7 + position * 3) % EXPERTS
    return np.array([[(first + layer) % EXPERTS, (first + layer + 1 + position % 3) % EXPERTS]
                     for layer in range(LAYERS)], np.int32)


class RoutingPolicy(ScriptedPolicy):
    """The scripted policy, answering each turn with routes for positions [routes_from, input + output - 1) as an
    engine with a prefix cache would (SGLang's routed_experts_start_len): every position routed by `_route_of`.
    `without_routes`: turns answered without. Keeps each request's routes_from by (trajectory, turn)."""

    def __init__(self, *args, without_routes=(), fail_turn=None, **kw):
        super().__init__(*args, **kw)
        self.without_routes, self.fail_turn = set(without_routes), fail_turn
        self.starts: dict[tuple[int, int], int] = {}

    def __call__(self, prompts, sampling, sessions=None, routes_from=None):
        if self.fail_turn is not None and any(len(self.sampled.get(self.uid_of(p), [])) == self.fail_turn
                                              for p in prompts):
            raise ConnectionError("the engine went away")
        assert routes_from is not None and len(routes_from) == len(prompts)
        turns = [len(self.sampled.get(self.uid_of(p), [])) for p in prompts]
        out, stats = super().__call__(prompts, sampling, sessions)
        for ids, res, (uid, turn), start in zip(prompts, out, zip(map(self.uid_of, prompts), turns), routes_from):
            assert 0 <= start <= len(ids)  # what SGLang accepts
            self.starts[uid, turn] = start
            seq = list(ids) + res.token_ids
            if (uid, turn) not in self.without_routes:
                res.routed_experts = np.stack([_route_of(t, p) for p, t in enumerate(seq[start:-1], start)])
        return out, stats


def _trajectories(qwen3, recheck_routes=False, **policy):
    from mgrpo.experience import Experience

    tools = ToolSet([FunctionTool(add)])
    runner = AgentRunner(MultiTurnConfig(enable=True, function_tools=["x:y"], recheck_routes=recheck_routes), qwen3,
                         tools, max_response_length=512)
    prompts = tool_prompts(qwen3, tools, 3)
    script = lambda uid, turn: call_text("add", {"a": uid, "b": turn}) if turn < 2 else f"{uid}"  # noqa: E731
    policy = RoutingPolicy(qwen3, script, prompts, **policy)
    sampling = SamplingParams(max_new_tokens=512, return_routed_experts=True)
    trajs, metrics = runner.run([(p, {}, "") for p in prompts], sampling, policy)
    items = [object()] * 3
    return trajs, metrics, lambda: Experience.from_trajectories(items, trajs, 1, want_routes=True), policy


@pytest.fixture(scope="module")
def qwen3():
    from transformers import AutoTokenizer

    from mgrpo.data.tokenizer import qwen3_tokenizer_dir

    return AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())


def test_the_runner_carries_every_positions_route_into_the_experience(qwen3):
    trajs, metrics, experience, policy = _trajectories(qwen3)
    exp = experience()
    for t, routes in zip(trajs, exp.routed_experts):
        assert t.finish_reason == "stop" and [x.role for x in t.turns] == ["assistant", "tool"] * 2 + ["assistant"]
        seq = t.prompt_ids + t.response_ids
        want = np.stack([_route_of(tok, p) for p, tok in enumerate(seq[:-1])])
        assert routes.dtype == np.uint8  # compact, as single-turn routes
        np.testing.assert_array_equal(routes, want)
    assert metrics["multi_turn/unrouted_positions"] == 0 and "multi_turn/route_rows_recomputed_differ" not in metrics
    # each turn asked only for the positions its trajectory had no route for: [fed by the turns before, ...)
    for t in trajs:
        starts = [policy.starts[t.uid, k] for k in range(3)]
        assert starts == [0] + [len(t.prompt_ids) + a.end - 1 for a in t.turns if a.role == "assistant"][:2]
    # so every row moved once: prompt + response - 1 per trajectory
    assert metrics["multi_turn/route_rows_received"] == sum(len(t.prompt_ids) + len(t.response_ids) - 1 for t in trajs)


def test_recheck_routes_asks_every_turn_for_its_whole_sequence_and_compares(qwen3):
    """rollout.multi_turn.recheck_routes: every turn asks from position 0 (SGLang's default), the rows it returns
    again equal the earlier turns' here (one deterministic router), the experience is the same, and the rows
    moved are the sum over turns of input + output - 1 (a trajectory's O(turns x length))."""
    trajs, metrics, experience, policy = _trajectories(qwen3, recheck_routes=True)
    exp = experience()
    for t, routes in zip(trajs, exp.routed_experts):
        seq = t.prompt_ids + t.response_ids
        np.testing.assert_array_equal(routes, np.stack([_route_of(tok, p) for p, tok in enumerate(seq[:-1])]))
    assert set(policy.starts.values()) == {0}
    assert metrics["multi_turn/route_rows_recomputed_differ"] == 0
    whole = sum(len(t.prompt_ids) + a.end - 1 for t in trajs for a in t.turns if a.role == "assistant")
    assert metrics["multi_turn/route_rows_received"] == whole
    once = sum(len(t.prompt_ids) + len(t.response_ids) - 1 for t in trajs)
    assert whole > 2 * once  # three turns of a growing sequence


def test_a_turn_without_routes_refuses_the_batch(qwen3):
    trajs, _, experience, _ = _trajectories(qwen3, without_routes={(1, 1)})
    assert trajs[1].routes_missing and not trajs[0].routes_missing
    with pytest.raises(RuntimeError, match=r"1 multi-turn trajectories got a turn without them \(e\.g\. 1\)"):
        experience()


def test_a_trajectory_failed_after_its_context_replays_no_made_up_route_in_the_loss(qwen3):
    """The engine fails every trajectory's second turn: each ends as generation_error after its first tool reply,
    which no forward fed (nor the first turn's last token): those rows get the default route and are counted."""
    trajs, metrics, experience, _ = _trajectories(qwen3, fail_turn=1)
    exp = experience()
    unrouted = 0
    for t, routes in zip(trajs, exp.routed_experts):
        assert t.finish_reason == "generation_error"
        seq = t.prompt_ids + t.response_ids
        end = t.turns[0].end + len(t.prompt_ids) - 1  # positions turn 0 returned
        np.testing.assert_array_equal(routes[:end], np.stack([_route_of(tok, p) for p, tok in enumerate(seq[:end])]))
        np.testing.assert_array_equal(routes[end:], np.broadcast_to([0, 1], (len(seq) - 1 - end, LAYERS, TOP_K)))
        unrouted += len(seq) - 1 - end
    assert unrouted == metrics["multi_turn/unrouted_positions"] > 3
    assert all(exp.outcomes[i] == "generation_error" for i in range(3))
