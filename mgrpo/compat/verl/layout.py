"""veRL's layout keys: the actor's and the reference's parallel sizes, offloading, Megatron engine settings,
and the number of rollout engines veRL would run.

mgrpo's reference model shares the actor's parallel layout, so every parallel key is treated alike for both:
the actor's value is translated (or refused by name when mgrpo has no such parallelism), the reference's is
accepted when it equals the actor's and refused by name otherwise. veRL's reference defaults to the actor's
value (`${oc.select:actor_rollout_ref.actor.megatron.<key>,...}` in its ppo_megatron_trainer.yaml), so an
unset actor key compares as veRL's default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from mgrpo.compat.verl.kit import A, F, FSDP, R, Refuse, Rule, falsy, ignore, only, refuse, to

VERL_GPUS_PER_NODE, VERL_NNODES, VERL_ROLLOUT_TP = 8, 1, 2
"""veRL's defaults for trainer.n_gpus_per_node, trainer.nnodes, actor_rollout_ref.rollout.tensor_model_parallel_size."""


@dataclass(frozen=True)
class ParallelKey:
    target: Optional[str]
    """The mgrpo key the actor's value becomes; None: mgrpo has no such parallelism (yet)."""
    default: Any
    """veRL's default (what an unset actor key means)."""
    accepted: tuple = ()
    """Without a target: the values that mean 'not used', accepted; any other is refused with `why`."""
    why: str = ""


# veRL's megatron.<key> for the actor and the reference.
MEGATRON_PARALLEL: dict[str, ParallelKey] = {
    "tensor_model_parallel_size": ParallelKey("actor.tp", 1),
    "pipeline_model_parallel_size": ParallelKey("actor.pp", 1),
    "context_parallel_size": ParallelKey("actor.cp", 1),
    "virtual_pipeline_model_parallel_size": ParallelKey(None, None, (None,), "mgrpo runs the non-interleaved 1F1B "
                                                                             "pipeline"),
    "expert_model_parallel_size": ParallelKey("actor.ep", 1),
    "expert_tensor_parallel_size": ParallelKey(None, None, (None, 1), "mgrpo's experts are not split by tensor "
                                                                      "parallelism (expert TP 1)"),
}
# FSDP's sequence parallelism (Ulysses) is context parallelism in Megatron's terms.
ULYSSES = ParallelKey("actor.cp", 1)


def _actor_parallel(pk: ParallelKey, default_sets_nothing: bool = False) -> Rule:
    """`default_sets_nothing`: the default leaves the target to another key (Ulysses 1 leaves actor.cp to
    megatron.context_parallel_size)."""
    def rule(v, ctx):
        if pk.target is not None:
            return [] if default_sets_nothing and v == pk.default else [(pk.target, int(v))]
        if v in pk.accepted:
            return [("", f"{v}: not used, as in mgrpo")]
        raise Refuse(pk.why)
    return rule


def _ref_parallel(actor_key: str, pk: ParallelKey) -> Rule:
    def rule(v, ctx):
        actor = ctx.get(actor_key, pk.default)
        if v == actor:
            return [("", "the reference shares the actor's layout in mgrpo")]
        raise Refuse(f"mgrpo's reference model shares the actor's layout ({actor_key}={actor}); set both alike")
    return rule


def _offload(*targets: str) -> Rule:
    """veRL's offload switches -> actor.offload.<target> (host memory while the engines generate)."""
    def rule(v, ctx):
        return [(f"actor.offload.{t}", not falsy(v)) for t in targets]
    return rule


def _nothing_to_offload(what: str) -> Rule:
    return ignore(f"the reference has no {what} (forward only); its parameters follow "
                  f"{F}megatron.param_offload (actor.offload.ref_params)")


OFFLOAD_RULES: dict[str, Rule] = {
    A + "megatron.param_offload": _offload("params"),
    A + "megatron.grad_offload": _offload("grads"),
    A + "megatron.optimizer_offload": _offload("optimizer"),
    F + "megatron.param_offload": _offload("ref_params"),
    F + "megatron.grad_offload": _nothing_to_offload("gradients"),
    F + "megatron.optimizer_offload": _nothing_to_offload("optimizer"),
    # FSDP's param_offload moves the module's gradients with its parameters (veRL's offload_fsdp_model_to_cpu)
    A + "fsdp_config.param_offload": _offload("params", "grads"),
    A + "fsdp_config.optimizer_offload": _offload("optimizer"),
    F + "fsdp_config.param_offload": _offload("ref_params"),
    F + "fsdp_config.optimizer_offload": _nothing_to_offload("optimizer"),
}
"""veRL's param/grad/optimizer offload, FSDP and Megatron, actor and reference -> actor.offload.*."""

OFFLOAD_INSTEAD = (f"use {A}megatron.optimizer_offload=True (actor.offload.optimizer: the optimizer's states in "
                   "host memory while the engines generate, its step on the accelerator)")
OPTIMIZER_OFFLOAD_OVERRIDES: dict[str, Rule] = {
    A + "optim.override_optimizer_config." + k: only(falsy, "off: the optimizer steps on the accelerator",
                                                     f"megatron's CPU optimizer (its step on the CPU) is not used; "
                                                     f"{OFFLOAD_INSTEAD}")
    for k in ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
              "use_precision_aware_optimizer")
}
"""megatron-core's HybridDeviceOptimizer knobs veRL passes through (its optimizer_cpu_offload)."""


def _model_engine(v, ctx):
    if v == "megatron":
        return [("", "megatron: mgrpo trains with Megatron-Core")]
    if v == "dp":
        return [("", "dp (veRL's FSDP engine): mgrpo trains with Megatron-Core; the FSDP keys are translated")]
    raise Refuse(f"mgrpo trains with Megatron-Core: model_engine=megatron (or leave it out); {v!r} has no mgrpo "
                 "equivalent")


# Megatron engine settings that hold for the reference as for the actor.
MEGATRON_ENGINE: dict[str, Rule] = {
    "use_mbridge": ignore("mgrpo converts HF <-> Megatron weights itself"),
    "vanilla_mbridge": ignore("mgrpo converts HF <-> Megatron weights itself"),
    "use_dist_checkpointing": only(falsy, "false: weights load from model.path",
                                   "mgrpo starts from the HF checkpoint in model.path"),
    "dist_checkpointing_path": only(falsy, "null", "mgrpo starts from the HF checkpoint in model.path"),
    "dist_checkpointing_prefix": ignore("used with use_dist_checkpointing"),
    "use_remove_padding": ignore("mgrpo packs sequences itself"),
    "sequence_parallel": ignore("mgrpo runs TP without sequence parallelism (same math; mgrpo-plan counts the "
                                "unsharded norm/residual activations)"),
    "override_transformer_config.attention_backend": ignore("mgrpo picks Transformer Engine attention on GPU"),
    **{f"override_transformer_config.{k}": ignore("fused kernel or memory setting (speed and memory only, same math)")
       for k in ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
                 "gradient_accumulation_fusion", "deallocate_pipeline_outputs", "persist_layer_norm",
                 "cross_entropy_loss_fusion")},
}


def _recompute(v, ctx):
    return [("", "off, as in mgrpo")] if v is None else [("actor.recompute", v)]


ROUTER_REPLAY = {None: "off", "disabled": "off", "R2": "old", "R3": "rollout"}
"""veRL's actor router_replay.mode -> actor.router_replay."""


def _router_replay(v, ctx):
    if v not in ROUTER_REPLAY:
        raise Refuse("veRL's router_replay.mode is disabled | R2 | R3")
    return [("actor.router_replay", ROUTER_REPLAY[v])]


LAYOUT_RULES: dict[str, Rule] = {
    **{A + "megatron." + k: _actor_parallel(pk) for k, pk in MEGATRON_PARALLEL.items()},
    **{F + "megatron." + k: _ref_parallel(A + "megatron." + k, pk) for k, pk in MEGATRON_PARALLEL.items()},
    A + "ulysses_sequence_parallel_size": _actor_parallel(ULYSSES, default_sets_nothing=True),
    F + "ulysses_sequence_parallel_size": _ref_parallel(A + "ulysses_sequence_parallel_size", ULYSSES),
    **{A + "megatron." + k: r for k, r in MEGATRON_ENGINE.items()},
    **{F + "megatron." + k: r for k, r in MEGATRON_ENGINE.items()},
    A + "megatron.use_distributed_optimizer": to("actor.use_distributed_optimizer", bool),
    F + "megatron.use_distributed_optimizer": ignore("the reference has no optimizer"),
    A + "megatron.seed": to("actor.seed", int),
    F + "megatron.seed": ignore("the reference runs forward only"),
    A + "megatron.dtype": to("actor.dtype", lambda v: {"bfloat16": "bf16", "bf16": "bf16", "float32": "fp32",
                                                       "fp32": "fp32"}.get(v, v)),
    A + "megatron.override_transformer_config.recompute_granularity": _recompute,
    **{A + f"megatron.override_transformer_config.recompute_{k}": ignore("part of recompute_granularity")
       for k in ("method", "num_layers", "modules")},
    F + "megatron.override_transformer_config.recompute_granularity": ignore("the reference runs forward only"),
    **OFFLOAD_RULES, **OPTIMIZER_OFFLOAD_OVERRIDES,
    "model_engine": _model_engine,
    # MoE routing replay (R2: replay the trainer's old-policy routing in the update; R3: the rollout engine's)
    A + "router_replay.mode": _router_replay,
    F + "router_replay.mode": ignore("the reference follows actor.router_replay: the rollout's routes under R3, "
                                     "its own routing otherwise"),
    R + "enable_rollout_routing_replay": ignore("mgrpo's engines return the routes exactly when the actor replays "
                                                "them (router_replay.mode=R3, actor.router_replay=rollout)"),
}
# megatron MoE settings veRL passes through override_transformer_config (both the actor's and the reference's)
for _who in (A, F):
    LAYOUT_RULES.update({
        _who + "megatron.override_transformer_config.moe_grouped_gemm":
            ignore("speed only: mgrpo's GPU spec uses Transformer Engine's grouped GEMM, the CPU one SequentialMLP"),
        _who + "megatron.override_transformer_config.moe_permute_fusion": ignore("speed only (token permutation)"),
        _who + "megatron.override_transformer_config.moe_router_dtype":
            only(lambda v: v in ("fp32", "float32"), "fp32: mgrpo's router runs in fp32, as Qwen3's",
                 "mgrpo's router runs in fp32"),
        _who + "megatron.override_transformer_config.moe_token_dispatcher_type":
            only(lambda v: v == "alltoall", "alltoall, mgrpo's dispatcher",
                 "mgrpo dispatches tokens with megatron's alltoall dispatcher (set it to alltoall)"),
        _who + "megatron.override_transformer_config.moe_enable_deepep":
            only(falsy, "false", "DeepEP is not used; mgrpo dispatches with megatron's alltoall"),
    })


LAYOUT_PREFIX_RULES: dict[str, Rule] = {
    A + "fsdp_config.": ignore(FSDP), F + "fsdp_config.": ignore(FSDP),
    A + "megatron.override_transformer_config.moe_": refuse("not passed to megatron's MoE layers (mgrpo sets the "
                                                             "router and dispatcher from config.json)"),
    F + "megatron.override_transformer_config.moe_": refuse("not passed to megatron's MoE layers"),
    A + "router_replay.": ignore("used with router_replay.mode"),
    F + "router_replay.": ignore("used with router_replay.mode"),
    A + "optim.override_optimizer_config.": refuse("not passed to megatron's optimizer (mgrpo's optimizer steps on "
                                                   f"the accelerator in fp32); for host memory {OFFLOAD_INSTEAD}"),
    A + "megatron.override_mcore_model_config.": refuse("mgrpo builds the model from config.json"),
    A + "megatron.override_ddp_config.": refuse("not passed to megatron's DDP"),
}


def rollout_engines(ctx: dict, given: set[str]) -> Optional[tuple[str, list[tuple[str, Any]]]]:
    """veRL's rollout layout: n_gpus_per_node x nnodes / rollout TP engines, colocated with the trainer
    (verl/experimental/agent_loop/agent_loop.py::_initialize_llm_servers: num_replicas = world_size //
    (tp x dp x pp), dp = pp = 1 here). Returns the table row's text and the mgrpo keys, or None when the
    line sets mgrpo's own rollout layout (rollout.num_engines, rollout.mode) or takes it from a recipe."""
    if given & {"rollout.num_engines", "rollout.mode", "recipe"}:
        return None
    gpus = ctx.get("trainer.n_gpus_per_node", VERL_GPUS_PER_NODE)
    nodes = ctx.get("trainer.nnodes", VERL_NNODES)
    tp_key = R + "tensor_model_parallel_size"
    tp = ctx.get(tp_key, ctx.get("rollout.tp"))
    out = []
    if tp is None:
        tp = VERL_ROLLOUT_TP
        out.append(("rollout.tp", tp))
    if not all(isinstance(x, int) and x > 0 for x in (gpus, nodes, tp)):
        return None  # not numbers: Hydra or the validator names the key
    engines = gpus * nodes // tp
    if engines < 1:
        raise Refuse(f"rollout TP {tp} is larger than the {gpus * nodes} GPUs (veRL would start no engine)")
    out.append(("rollout.num_engines", engines))
    unset = "" if tp_key in ctx or "rollout.tp" in ctx else f" (rollout TP unset: veRL's default {VERL_ROLLOUT_TP})"
    return (f"{gpus} GPUs x {nodes} node(s) / rollout TP {tp} = {engines} engine(s), colocated, as veRL runs them"
            f"{unset}", out)
