"""Routing replay of a mixture-of-experts model stage on megatron-core's own RouterReplay.

megatron builds a `RouterReplay` in every router when `moe_enable_routing_replay` is set; the router's top-k
then asks it (`get_replay_topk`): RECORD keeps the router's choice, REPLAY_FORWARD takes the target indices
instead (the routing weights are the router's own scores gathered at them), REPLAY_BACKWARD pops the next
target of a list, for the forward that full activation recompute runs again in backward.

Contracts of megatron's routers that the targets must follow:
  - token order: a router sees its stage's tokens as [s, b] flattened (sequence-major), so padded
    micro-batches [b, s] are transposed; THD packs are one row, the samples end to end;
  - under sequence parallelism each TP rank routes its 1/tp slice of s; under CP the rank's chunks are
    already all its micro-batch holds (training/batch.py lays them out);
  - targets are global expert ids [tokens, top_k], int64; every slot needs distinct valid ids, so a sample's
    last token (no rollout route: it was never fed back) and padding get `default_route`;
  - with full recompute the backward's second forward pops the targets in micro-batch order: after each
    forward the action switches to REPLAY_BACKWARD, before the next one back to REPLAY_FORWARD;
  - megatron's `RouterReplay.global_router_replay_instances` is one list per process, holding the actor's
    and the reference's routers alike: `ModelRouting` takes its model's instances out of it and drives
    them itself, so targets are set per model; a pass that set targets clears them after (forward-only
    passes never pop the backward list).

`LayerReplay` also measures, without changing what is replayed: per expert, the tokens it was sent (load),
and, while replaying, how many tokens' replayed top-k set the router would have chosen by itself (the
same scores through megatron's own top-k: actor/router/agreement, see `routing_metrics`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from mgrpo.training.rank_batch import compact_routes

REPLAY, RECORD = "replay", "record"
"""What a pass does with the routes: follow the micro-batches' targets, or keep the routers' own choice."""


def router_order(x: torch.Tensor, sp: int = 1, sp_rank: int = 0) -> torch.Tensor:
    """`x` laid out like a micro-batch's tokens ([b, s, ...]: padded rows, or [1, t, ...] packed) -> the order
    this rank's routers see them in ([tokens, ...]): sequence-major, and under sequence parallelism over `sp`
    TP ranks the `sp_rank`-th of sp equal slices of s (megatron's scatter_to_sequence_parallel_region)."""
    x = x.transpose(0, 1)
    if sp > 1:
        x = x.split(x.shape[0] // sp)[sp_rank]
    return x.reshape(-1, *x.shape[2:])


def default_route(tokens: int, top_k: int, device=None) -> torch.Tensor:
    """Experts 0..k-1 for slots without a route (a sample's last token, padding): distinct valid ids whose
    output nothing reads (the last token predicts past the response; padding is masked out)."""
    return torch.arange(top_k, device=device).expand(tokens, top_k).clone()


class LayerReplay(RouterReplay):
    """megatron's RouterReplay of one router, owned by its model's `ModelRouting` (not in the process-wide
    list), counting what it routed."""

    def __init__(self, num_experts: int):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.num_experts = num_experts
        self.measure = False
        self.real: Optional[torch.Tensor] = None
        """[tokens] True at real tokens (not padding): counted in the load."""
        self.valid: Optional[torch.Tensor] = None
        """[tokens] True where the target is a real route: counted in the agreement."""
        self.reset_counts()

    def reset_counts(self) -> None:
        self.load = torch.zeros(self.num_experts, dtype=torch.float64)
        self.agree = 0
        self.checked = 0

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        action = self.router_replay_action
        probs, top = super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        if self.measure and action != RouterReplayAction.REPLAY_BACKWARD:  # a recompute is not a new routing
            with torch.no_grad():
                self._count(scores, topk, num_groups, group_topk, default_compute_topk, top, action)
        return probs, top

    def _count(self, scores, topk, num_groups, group_topk, default_compute_topk, top, action) -> None:
        if self.real is None or self.real.numel() != top.shape[0]:
            raise RuntimeError(f"routing replay: the router got {top.shape[0]} tokens, the micro-batch's masks "
                               f"{None if self.real is None else self.real.numel()} (token order out of step)")
        used = top[self.real].flatten()
        self.load += torch.bincount(used.cpu(), minlength=self.num_experts).double()
        if action == RouterReplayAction.REPLAY_FORWARD:
            _, own = default_compute_topk(scores, topk, num_groups, group_topk)
            same = (own.sort(dim=1).values == top.sort(dim=1).values).all(dim=1)
            self.agree += int((same & self.valid).sum())
            self.checked += int(self.valid.sum())


class ModelRouting:
    """Every router of one model stage (the actor's or the reference's) and what each micro-batch replays.

    A pass (one megatron schedule run) is `start(action, measure)`, then `begin(mb)` / `end(mb)` around each
    micro-batch's forward (the forward step functions call them), then `finish()`."""

    def __init__(self, model: torch.nn.Module, *, sp: int = 1, sp_rank: int = 0):
        from megatron.core.transformer.moe.router import TopKRouter

        self.sp, self.sp_rank = sp, sp_rank
        self.layers: list[tuple[int, LayerReplay]] = []
        """(global layer index, its replay) of this stage's routers, in layer order."""
        self.top_k = 0
        for module in model.modules():
            if not isinstance(module, TopKRouter):
                continue
            if module.router_replay is None:
                raise RuntimeError("routing replay: the model was built without moe_enable_routing_replay "
                                   "(transformer_config(..., routing_replay=True))")
            if module.router_replay in RouterReplay.global_router_replay_instances:
                RouterReplay.global_router_replay_instances.remove(module.router_replay)
            module.router_replay = LayerReplay(module.config.num_moe_experts)
            self.layers.append((module.layer_number - 1, module.router_replay))
            self.top_k = module.topk
        self.action: Optional[str] = None
        self.recorded: list[list[torch.Tensor]] = []
        """RECORD: per micro-batch, each layer's [tokens, k] choice in router order."""

    # --- one pass --------------------------------------------------------------------------------------
    def start(self, action: Optional[str], measure: bool = False) -> None:
        self.action, self.recorded = action, []
        for _, r in self.layers:
            r.clear_indices()
            r.measure = measure
            if measure:
                r.reset_counts()

    def begin(self, mb) -> None:
        """Before the micro-batch's forward: masks, targets and the action of every router."""
        rows = router_order(mb.route_rows, self.sp, self.sp_rank)
        real = ~router_order(mb.padding_mask, self.sp, self.sp_rank)
        valid = rows >= 0
        if self.action == REPLAY:
            routes = mb.routes
            if routes is None:
                raise ValueError("routing replay: the micro-batch carries no routed experts")
            if routes.shape[1] <= max(i for i, _ in self.layers) or routes.shape[2] != self.top_k:
                raise ValueError(f"routing replay: routes of {routes.shape[1]} layers x top-{routes.shape[2]} for a "
                                 f"model whose layers {[i for i, _ in self.layers]} route top-{self.top_k}")
        for layer, r in self.layers:
            r.real, r.valid = real, valid
            if self.action == REPLAY:
                target = default_route(rows.numel(), self.top_k, device=rows.device)
                target[valid] = routes[rows[valid], layer].long()
                r.set_target_indices(target)
                r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            elif self.action == RECORD:
                r.set_router_replay_action(RouterReplayAction.RECORD)
            else:
                r.clear_router_replay_action()

    def end(self, mb) -> None:
        """After the micro-batch's forward: keep what was recorded; a recompute in backward pops the targets."""
        if self.action == RECORD:
            self.recorded.append([r.get_recorded_indices() for _, r in self.layers])
        elif self.action == REPLAY:
            for _, r in self.layers:
                r.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def finish(self) -> None:
        """After the pass: no targets, backward lists or masks stay behind, and the routers route by themselves."""
        for _, r in self.layers:
            r.clear_indices()
            r.clear_router_replay_action()
            r.real = r.valid = None
            r.measure = False
        self.action = None

    # --- results -----------------------------------------------------------------------------------------
    def recorded_per_sample(self, mbs: Sequence, groups: Sequence[Sequence[int]], lengths: Sequence[int], ctx,
                            num_layers: int) -> Optional[list[np.ndarray]]:
        """After a RECORD pass: per sample of the batch (lengths in its order), [length - 1, num_layers, k]
        expert ids, on the rank that reports (None elsewhere). Each rank fills the rows it routed; the
        sequence-parallel and CP ranks of a stage complete them (every row is routed by exactly one of
        them) and the last pipeline stage collects the other stages' layers."""
        mine = [i for i, _ in self.layers]
        per_sample: list = [None] * len(lengths)
        for mb, idx, got in zip(mbs, groups, self.recorded):
            rows = router_order(mb.route_rows, self.sp, self.sp_rank)
            valid = rows >= 0
            out = torch.zeros(int(sum(lengths[i] - 1 for i in idx)), len(mine), self.top_k, dtype=torch.int64,
                              device=rows.device)
            for j, choice in enumerate(got):
                out[rows[valid], j] = choice[valid].long()
            if self.sp > 1:
                dist.all_reduce(out, group=ctx.tp_group)
            if ctx.cp > 1:
                dist.all_reduce(out, group=ctx.cp_group)
            for i, part in zip(idx, torch.split(out.cpu(), [lengths[i] - 1 for i in idx])):
                per_sample[i] = part
        if ctx.pp > 1:  # every stage's layers to the last one
            stages: list = [None] * ctx.pp if ctx.is_last_stage else None
            dist.gather_object((mine, per_sample), stages, dst=dist.get_global_rank(ctx.pp_group, ctx.pp - 1),
                               group=ctx.pp_group)
            if not ctx.is_last_stage:
                return None
            mine = [layer for layers, _ in stages for layer in layers]
            per_sample = [torch.cat([s[i] for _, s in stages], dim=1) for i in range(len(lengths))]
        if not ctx.reports:
            return None
        if mine != list(range(num_layers)):
            raise RuntimeError(f"routing replay: recorded layers {mine}, expected 0..{num_layers - 1}")
        return [compact_routes(p.numpy()) for p in per_sample]

    def counts(self, num_layers: int, num_experts: int) -> torch.Tensor:
        """This rank's [agree per layer, checked per layer, load per (layer, expert)] since `start(measure=True)`."""
        vec = torch.zeros(num_layers * (2 + num_experts), dtype=torch.float64)
        for layer, r in self.layers:
            vec[layer], vec[num_layers + layer] = r.agree, r.checked
            start = 2 * num_layers + layer * num_experts
            vec[start:start + num_experts] = r.load
        return vec


def routing_metrics(routing: ModelRouting, ctx, *, num_layers: int, num_experts: int, replayed: bool) -> dict:
    """The step's routing metrics, the same on every rank: counts summed over the ranks that route distinct
    tokens (data-parallel and CP ranks, TP ranks under sequence parallelism) and layers (pipeline stages).

    actor/router/agreement (when replaying; per layer under actor/router/agreement/layer_i): share of the
    (token, layer) routings whose replayed top-k set the router, on the hidden states of the replayed forward,
    would have chosen by itself (layer 0's input does not depend on routing; a later layer's is the one the
    replayed routes produced, so disagreement upstream is not counted again downstream);
    actor/router/imbalance/layer_i: the most tokens any expert of layer i received over the mean (1 =
    balanced, num_experts / top_k = every token to the same k experts)."""
    vec = routing.counts(num_layers, num_experts)
    dist.all_reduce(vec, group=ctx.dp_cp_group)
    if routing.sp > 1:
        dist.all_reduce(vec, group=ctx.tp_group)
    if ctx.pp > 1:
        dist.all_reduce(vec, group=ctx.pp_group)
    out = {}
    if replayed:
        agree, checked = vec[:num_layers], vec[num_layers:2 * num_layers]
        out["actor/router/agreement"] = float(agree.sum() / max(float(checked.sum()), 1.0))
        for i in range(num_layers):
            out[f"actor/router/agreement/layer_{i}"] = float(agree[i] / max(float(checked[i]), 1.0))
    load = vec[2 * num_layers:].view(num_layers, num_experts)
    for i, row in enumerate(load):
        out[f"actor/router/imbalance/layer_{i}"] = float(row.max() / row.mean()) if row.sum() > 0 else 1.0
    return out
