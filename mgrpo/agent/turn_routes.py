"""A multi-turn trajectory's routed experts (actor.router_replay=rollout, R3), assembled from its turns.

Every turn is one `/generate` of the trajectory's ids so far (P tokens) returning O tokens, and with them the
experts of positions [0, P + O - 1) (int32 [P + O - 1, layers, top_k]: every position but the last, which
was never fed back). The trainer replays one route per position of prompt + response, [len - 1, L, K]. Each
position's route is taken from the turn whose forward first computed it:
  - a sampled token of turn t but its last: turn t (the decode step that fed it generated the next token);
  - turn t's last sampled token and the context after it (tool replies, the template's next generation
    prompt, an end-of-turn the stop string cut): turn t + 1's prefill, the first forward that fed them.
So turn t adds the rows [len(known), P_t + O_t - 1) to those of the turns before, and that is all it asks the
engine for: SGLang's `routed_experts_start_len` = len(known) (io_struct.py GenerateReqInput; the scheduler
refuses it outside [0, prompt tokens], state_capturer/base.py::get_topk returns positions [start_len,
seqlen - 1)). A trajectory of T turns then moves each row once, not O(T) times (whole routes per turn:
O(T x length) rows). With rollout.multi_turn.recheck_routes every turn asks for all of its rows (start 0)
and the rows it returns again for earlier positions are compared, not used.

Why this is right for SGLang 0.5.23: the routes of a request are read, when it finishes, from a host buffer
indexed by KV-cache slot (srt/state_capturer/base.py::BaseTopkCapturer.get_topk over
req_to_token[start:seqlen - 1]); each forward writes the routes of the tokens it computed into their slots
(`on_forward_end`, at out_cache_loc). A prefix the radix cache served keeps its slots, so its rows are those
written by the forward that computed the prefix first, the same ones an earlier turn returned: what the KV
every later token attended to was built with. A prefix SGLang computed again (evicted, another engine, a
page not yet full) is routed again; in exact arithmetic identically, with different rounding perhaps not.
Earlier turns' sampled tokens were scored on the first computation, so that one is kept; with recheck_routes
the rows that differ are counted (`multi_turn/route_rows_recomputed_differ`, 0 when every prefix was cached):
a diagnostic of cache misses, off by default because it costs the O(T^2) route bytes it measures. The engines
here without a prefix cache (the in-process engine, the CPU server) compute every turn's prefix again.
Nothing under SGLang's srt/mem_cache/ writes the routes buffer: a prefix that a hierarchical cache evicted
to host memory and loads back into newly allocated KV slots comes back without its routes (those slots'
rows are stale). Rows of positions an earlier turn returned are never taken from a later turn, so here
that can only touch a trajectory's first turn (its prompt), as it touches a single-turn request.

A turn answered without routes (an engine that ignores return_routed_experts) is never replayed partially:
the trajectory is marked and `Experience.from_trajectories` refuses the batch. A failed trajectory (it has no
reward and leaves the loss and its group's baseline) may end before the engine fed its last tokens: context
appended after its last turn, or no turn at all. Those positions get experts 0..k-1 (what the trainer gives a
sample's last token and padding: training/router_replay.py::default_route), counted in
`multi_turn/unrouted_positions`; no token of a sample in the loss depends on them. They do count in
actor/router/agreement (the trainer sees them as routed rows), which reads below 1.0 by at most
unrouted_positions / routed tokens in a step with such trajectories.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np

if TYPE_CHECKING:
    from mgrpo.agent.trajectory import Trajectory
    from mgrpo.rollout.types import GenerateResult


class RoutesError(ValueError):
    pass


def extend_routes(known: Optional[np.ndarray], turn: np.ndarray, fed: int, out_len: int,
                  start: int = 0) -> tuple[np.ndarray, int]:
    """The trajectory's routes after one more turn, and how many of the turn's rows for positions already
    known differ from them. `known`: rows [0, n) of the earlier turns (None before the first); `turn`: the
    engine's routes of positions [start, fed + out_len - 1) (SGLang's routed_experts_start_len) of a request of
    `fed` input ids that returned `out_len` tokens. start = n asks for the new rows only; start < n also returns
    rows [start, n) again, which are compared, not used; start > n would leave positions without a route."""
    want = fed + out_len - 1 - start
    if turn.ndim != 3 or turn.shape[0] != want:
        raise RoutesError(f"a turn of {fed} input and {out_len} output tokens came with routed experts of shape "
                          f"{tuple(turn.shape)} (expected [{want}, layers, top_k] from position {start})")
    n = 0 if known is None else known.shape[0]
    if start > n:
        raise RoutesError(f"a turn's routed experts start at position {start}, but earlier turns routed only {n}")
    if known is None:
        return turn, 0
    if known.shape[1:] != turn.shape[1:]:
        raise RoutesError(f"a turn's routed experts are {turn.shape[1]} layers x top-{turn.shape[2]}, the earlier "
                          f"turns' {known.shape[1]} x top-{known.shape[2]}")
    if n > fed:  # every earlier row is of a position before the last input id (it was fed back since)
        raise RoutesError(f"{n} positions routed by earlier turns, but this turn continued from {fed} ids")
    again = n - start  # rows of positions [start, n): known already
    same = np.all(np.sort(turn[:again], -1) == np.sort(known[start:], -1), axis=(1, 2))
    return np.concatenate([known, turn[again:].astype(known.dtype, copy=False)]), int((~same).sum())


def trajectory_routes(routes: Optional[np.ndarray], length: int, failed: bool, shape: tuple[int, int],
                      uid: int) -> tuple[np.ndarray, int]:
    """The [length - 1, L, K] rows the trainer replays for a trajectory of `length` ids (prompt + response),
    and how many of them no engine forward computed (filled with experts 0..k-1; only a failed trajectory may
    have such rows)."""
    have = 0 if routes is None else routes.shape[0]
    missing = length - 1 - have
    if missing < 0:
        raise RoutesError(f"trajectory {uid}: {have} routed positions for {length} ids")
    if missing and not failed:
        raise RoutesError(f"trajectory {uid}: the engine routed {have} of its {length - 1} positions; a finished "
                          "trajectory ends on a turn the engine generated, so every position must have its route")
    if not missing:
        return routes, 0
    layers, top_k = shape
    fill = np.broadcast_to(np.arange(top_k, dtype=np.int32), (missing, layers, top_k))
    return (fill.copy() if routes is None else np.concatenate([routes, fill.astype(routes.dtype)])), missing


def add_turn_routes(traj: "Trajectory", res: "GenerateResult", fed: int, start: int) -> None:
    """The turn's routed experts (positions [start, fed + output - 1)) into the trajectory's (each position from
    the turn that first computed it)."""
    if res.routed_experts is None:
        traj.routes_missing = True
        return
    try:
        traj.routes, differ = extend_routes(traj.routes, res.routed_experts, fed, len(res.token_ids), start)
    except RoutesError as err:
        raise RoutesError(f"trajectory {traj.uid}, turn {traj.counts.get('turns', 0) + 1}: {err}") from None
    if differ:
        traj.count("multi_turn/route_rows_recomputed_differ", differ)


def finish_routes(trajs: Sequence["Trajectory"], measured: dict, rechecked: bool) -> None:
    """Every trajectory's routes to [prompt + response - 1, L, K] (a failed one's positions that no engine
    forward computed filled and counted, mgrpo/agent/routes.py); skipped when no turn returned any."""
    shape = next((t.routes.shape[1:] for t in trajs if t.routes is not None), None)
    unrouted = 0
    for t in trajs:
        if shape is not None and not t.routes_missing:
            t.routes, n = trajectory_routes(t.routes, len(t.prompt_ids) + len(t.response_ids), t.failed, shape,
                                            t.uid)
            unrouted += n
    measured["multi_turn/unrouted_positions"] = unrouted
    measured.setdefault("multi_turn/route_rows_received", 0)
    if rechecked:  # only then does a turn return rows an earlier turn returned (to compare)
        measured.setdefault("multi_turn/route_rows_recomputed_differ", 0)
