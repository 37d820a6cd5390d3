"""mgrpo-plan: the resource plan of a run, from the same Hydra overrides as mgrpo-train; starts nothing.

    mgrpo-plan                                            # the default CPU job
    mgrpo-plan actor.tp=2 trainer.n_gpus_per_node=4       # world, TP/PP/CP/DP, who sits where
    mgrpo-plan cluster=slurm_h100 model=qwen3-8b rollout=sglang trainer.nnodes=2 actor.tp=4
    mgrpo-plan ... --json                                 # machine-readable
    mgrpo-plan ... --dtype bf16                           # memory as if the actor trained in bf16

It composes and validates the config exactly as mgrpo-train does (an invalid config exits with
status 2 and the validator's message), then prints: nodes x accelerators; the trainer's world and
its TP/PP/CP/DP split; which bundle (rank) goes to which node and local accelerator with its
tp/pp/cp/dp ranks; the rollout engines and their accelerators; the batch arithmetic of one step; and a
rough memory estimate per accelerator for the actor's weights, gradients and Adam states plus the
frozen reference model.

The memory estimate counts parameters from the model config (what megatron builds: vocabulary padded
to make_vocab_size_divisible_by * tp, attention with GQA and head_dim, SwiGLU MLP, RMSNorms including
Qwen3's q/k norms). It leaves out activations, logits, communication buffers, the CUDA context,
allocator fragmentation, FP8 copies and the colocated rollout engine's memory; `notes` says so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, Sequence

from mgrpo.config import ConfigError, Layout, MGRPOConfig, output_dir, validate
from mgrpo.models.registry import param_counts  # the model family's count; imports no torch

GIB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
TRAINER_DTYPE = "fp32"
"""What MegatronActor builds today: fp32 parameters and the fp32 (non mixed-precision) optimizer."""


def compose_config(overrides: Sequence[str]) -> MGRPOConfig:
    """The typed config mgrpo-train would run with these overrides."""
    from hydra import compose, initialize_config_dir

    from mgrpo_launchers.train import CONFIG_DIR, to_config  # also registers the structured schema

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=list(overrides)))


# --- memory ------------------------------------------------------------------------------------------
def memory_estimate(cfg: MGRPOConfig, lay: Layout, dtype: str = TRAINER_DTYPE) -> dict:
    """Bytes per accelerator on the heaviest pipeline stage: actor weights, gradients, Adam states,
    reference weights.

    fp32 (the trainer today): weights 4 + fp32 gradient buffer 4 + Adam m, v 8 = 16 B/param.
    bf16 mixed precision: weights 2 + fp32 gradient buffer 4 (grad_reduce_in_fp32) + fp32 master 4 +
    Adam 8 = 18 B/param. actor.use_distributed_optimizer shards master and Adam states over DP.
    The reference holds weights only, sharded like the actor."""
    a, al = cfg.actor, cfg.algorithm
    counts = param_counts(cfg.model, a.tp, a.pp)
    stage = max(range(a.pp), key=lambda s: counts["per_rank_by_stage"][s])
    n = counts["per_rank_by_stage"][stage]
    w = DTYPE_BYTES[dtype]
    states = 8 + (4 if dtype != "fp32" else 0)  # Adam m and v (+ fp32 master copy when weights are bf16)
    shard = lay.dp if a.use_distributed_optimizer else 1
    need_ref = al.use_kl_loss or al.use_kl_in_reward
    parts = {
        "actor_weights": n * w,
        "actor_grads": n * 4,
        "optimizer_states": n * states / shard,
        "reference_weights": n * w if need_ref else 0,
    }
    total = sum(parts.values())
    return {
        "dtype": dtype,
        "params_per_rank": n,
        "heaviest_stage": stage,
        "bytes": {k: int(v) for k, v in parts.items()} | {"total": int(total)},
        "gib": {k: round(v / GIB, 3) for k, v in parts.items()} | {"total": round(total / GIB, 3)},
        "bytes_per_param": {"weights": w, "grads": 4, "optimizer": states / shard,
                            "reference": w if need_ref else 0},
        "left_out": [
            "activations and logits of a micro-batch (grow with actor.max_tokens_per_gpu; log-probs are "
            "computed in chunks of actor.logprob_chunk_size tokens)",
            "CUDA context, NCCL/gloo buffers and allocator fragmentation (typically 1-3 GiB per GPU)",
            "FP8 weight copies and scaling state (actor.fp8)",
            "the weight-sync buckets (rollout.update_weights_bucket_mb) and gathered HF tensors",
            "a colocated rollout engine: SGLang takes rollout.gpu_memory_utilization of each GPU while "
            "generating and releases it for training",
        ],
    }


# --- placement and batch -----------------------------------------------------------------------------
def rank_coords(rank: int, tp: int, cp: int, dp: int) -> dict:
    """Megatron's default rank order 'tp-cp-ep-dp-pp': tp varies fastest, pp slowest."""
    return {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp, "pp": rank // (tp * cp * dp)}


def placement(cfg: MGRPOConfig, lay: Layout) -> tuple[list[dict], list[dict]]:
    """Trainer ranks and rollout engines on (node, local accelerator), in the order Ray's PACK strategy
    fills the nodes (Ray may pick other nodes; the grouping into nodes is what matters)."""
    a, r = cfg.actor, cfg.rollout
    per_node = lay.total // cfg.trainer.nnodes
    ranks = []
    for i in range(lay.trainer_world):
        c = rank_coords(i, a.tp, a.cp, lay.dp)
        role = []
        if c["tp"] == 0 and c["dp"] == 0 and c["cp"] == 0:
            role.append("weight source")
        if a.pp > 1 and c["pp"] == a.pp - 1:
            role.append("last stage")
        ranks.append({"rank": i, "node": i // per_node, "local": i % per_node, **c, "role": ", ".join(role)})
    first = 0 if r.mode == "colocated" else lay.trainer_world
    engines = []
    for e in range(r.num_engines):
        slots = [first + e * r.tp + k for k in range(r.tp)]
        engines.append({"engine": e, "tp": r.tp, "accelerators": [[s // per_node, s % per_node] for s in slots],
                        "shares_with_trainer_ranks": [s for s in slots if s < lay.trainer_world]
                        if r.mode == "colocated" else []})
    return ranks, engines


def batch_plan(cfg: MGRPOConfig, lay: Layout) -> dict:
    d, a, r = cfg.data, cfg.actor, cfg.rollout
    mini = a.ppo_mini_batch_size or d.train_batch_size
    n_mini = d.train_batch_size // mini
    seq = d.max_prompt_length + d.max_response_length
    per_dp = math.ceil(mini * r.n / lay.dp)
    per_micro = max(a.max_tokens_per_gpu // seq, 1)
    out = {
        "prompts_per_step": d.train_batch_size,
        "samples_per_prompt": r.n,
        "samples_per_step": d.train_batch_size * r.n,
        "max_tokens_per_step": d.train_batch_size * r.n * seq,
        "max_sequence_tokens": seq,
        "mini_batch_prompts": mini,
        "mini_batches_per_step": n_mini,
        "ppo_epochs": a.ppo_epochs,
        "optimizer_steps_per_step": n_mini * a.ppo_epochs,
        "samples_per_dp_rank_per_mini_batch": per_dp,
        "token_budget_per_micro_batch": a.max_tokens_per_gpu,
        "max_length_samples_per_micro_batch": per_micro,
        "micro_batches_per_dp_rank_per_mini_batch_at_most": math.ceil(per_dp / per_micro),
        "total_training_steps": cfg.trainer.total_training_steps,
        "total_epochs": cfg.trainer.total_epochs,
        "warnings": [],
    }
    if mini * r.n < lay.dp:
        out["warnings"].append(f"a mini-batch has {mini * r.n} samples for {lay.dp} data-parallel replicas: "
                               "the trainer refuses to split it (raise data.train_batch_size or rollout.n)")
    if cfg.algorithm.filter_groups.enable:
        out["warnings"].append("algorithm.filter_groups: a step may run up to "
                               f"{cfg.algorithm.filter_groups.max_num_gen_batches or 'unlimited'} generation rounds")
    if a.pp > 1:
        m = out["micro_batches_per_dp_rank_per_mini_batch_at_most"]
        if m < a.pp:
            out["warnings"].append(f"at most {m} micro-batch(es) per mini-batch for actor.pp={a.pp} stages: "
                                   "the pipeline stays mostly idle (lower actor.max_tokens_per_gpu)")
    return out


# --- the plan ----------------------------------------------------------------------------------------
def build_plan(cfg: MGRPOConfig, *, dtype: str = TRAINER_DTYPE) -> dict:
    """Validate and lay out a run; raises ConfigError like mgrpo-train."""
    lay = validate(cfg)
    a, r, t, m = cfg.actor, cfg.rollout, cfg.trainer, cfg.model
    ranks, engines = placement(cfg, lay)
    counts = param_counts(m, a.tp, a.pp)
    return {
        "output_dir": output_dir(cfg),
        "device": t.device,
        "cluster": {"nodes": t.nnodes, "accelerators_per_node": lay.total // t.nnodes, "accelerators": lay.total,
                    "cpus_per_worker": t.cpus_per_worker, "ray_address": t.ray_address,
                    # every trainer rank and every engine is a Ray bundle of cpus_per_worker CPUs
                    "ray_cpus_needed": (lay.trainer_world + r.num_engines) * t.cpus_per_worker},
        "trainer": {"world": lay.trainer_world, "tp": a.tp, "pp": a.pp, "cp": a.cp, "dp": lay.dp,
                    "layers_per_stage": m.num_layers // a.pp, "ranks": ranks},
        "rollout": {"engine": r.engine, "mode": r.mode, "num_engines": r.num_engines, "tp": r.tp,
                    "accelerators": lay.rollout_devices, "engines": engines},
        "batch": batch_plan(cfg, lay),
        "model": {"name": m.name, "params_hf": counts["hf_total"], "params_megatron": counts["megatron_total"],
                  "padded_vocab": counts["padded_vocab"], "params_per_layer": counts["layer"],
                  "params_per_rank_by_stage": counts["per_rank_by_stage"]},
        "memory_per_accelerator": memory_estimate(cfg, lay, dtype),
    }


def _fmt(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 1024**2:.2f} MiB"


def render(p: dict) -> str:
    c, tr, ro, b, mo, me = p["cluster"], p["trainer"], p["rollout"], p["batch"], p["model"], p["memory_per_accelerator"]
    acc = "GPUs" if p["device"] == "cuda" else "CPU bundles" if p["device"] == "cpu" else "accelerators"
    out = [f"mgrpo plan (nothing started)   output_dir: {p['output_dir']}",
           f"cluster   {c['nodes']} node(s) x {c['accelerators_per_node']} {acc} = {c['accelerators']}  "
           f"(trainer.device={p['device']}; Ray needs {c['ray_cpus_needed']} CPUs: "
           f"{tr['world']} rank(s) + {ro['num_engines']} engine(s) x {c['cpus_per_worker']})",
           f"trainer   world {tr['world']} = tp {tr['tp']} x pp {tr['pp']} x cp {tr['cp']} x dp {tr['dp']}  "
           f"({tr['layers_per_stage']} layer(s) per pipeline stage)"]
    if ro["mode"] == "colocated":
        where = "colocated: shares the trainer's accelerators (memory released while training)"
    else:
        where = f"disaggregated: its own {ro['accelerators']} accelerator(s) after the trainer's"
    out.append(f"rollout   {ro['num_engines']} {ro['engine']} engine(s) x tp {ro['tp']} = {ro['accelerators']} "
               f"accelerator(s), {where}")
    out.append("")
    out.append("placement (rank = trainer bundle; Ray's PACK strategy fills nodes in this order)")
    out.append("  rank  node  local    tp  pp  cp  dp  role")
    for r in tr["ranks"]:
        out.append(f"  {r['rank']:>4}  {r['node']:>4}  {r['local']:>5}  {r['tp']:>4}{r['pp']:>4}{r['cp']:>4}"
                   f"{r['dp']:>4}  {r['role']}")
    for e in ro["engines"]:
        accs = " ".join(f"{n}:{i}" for n, i in e["accelerators"])
        share = f" (with trainer ranks {', '.join(map(str, e['shares_with_trainer_ranks']))})" \
            if e["shares_with_trainer_ranks"] else ""
        out.append(f"  engine {e['engine']}: node:local {accs}{share}")
    out.append("")
    steps = b["total_training_steps"] if b["total_training_steps"] is not None else \
        f"{b['total_epochs']} epoch(s) over the data"
    out += [
        f"batch     {b['prompts_per_step']} prompts x n {b['samples_per_prompt']} = {b['samples_per_step']} samples "
        f"per step (<= {b['max_tokens_per_step']:,} tokens at {b['max_sequence_tokens']} per sequence); "
        f"steps: {steps}",
        f"          {b['mini_batches_per_step']} mini-batch(es) of {b['mini_batch_prompts']} prompts x ppo_epochs "
        f"{b['ppo_epochs']} = {b['optimizer_steps_per_step']} optimizer step(s) per step",
        f"          per DP rank and mini-batch: ~{b['samples_per_dp_rank_per_mini_batch']} samples; token budget "
        f"{b['token_budget_per_micro_batch']} = {b['max_length_samples_per_micro_batch']} max-length sample(s) per "
        f"micro-batch -> at most {b['micro_batches_per_dp_rank_per_mini_batch_at_most']} micro-batch(es)",
    ]
    out += [f"  warning: {w}" for w in b["warnings"]]
    out.append("")
    out.append(f"model     {mo['name']}: {_fmt(mo['params_hf'])} params ({mo['params_hf']:,} in HF layout; "
               f"{mo['params_megatron']:,} in megatron with the vocabulary padded to {mo['padded_vocab']:,})")
    nb, bp = me["bytes"], me["bytes_per_param"]
    out.append(f"memory    per accelerator, heaviest stage ({me['heaviest_stage']}), {me['params_per_rank']:,} params "
               f"per rank, {me['dtype']}:")
    out.append(f"          actor weights {_size(nb['actor_weights'])} ({bp['weights']} B/param) + grads "
               f"{_size(nb['actor_grads'])} ({bp['grads']} B) + Adam states {_size(nb['optimizer_states'])} "
               f"({bp['optimizer']:g} B) + reference {_size(nb['reference_weights'])} ({bp['reference']} B)")
    out.append(f"          = {_size(nb['total'])} ({nb['total']:,} bytes), a lower bound; not counted:")
    out += [f"            - {x}" for x in me["left_out"]]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="mgrpo-plan", description=__doc__.split("\n\n")[0],
                                     epilog="Overrides are the same as mgrpo-train's, e.g. actor.tp=2 model=qwen3-8b.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (key=value, group=option)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=TRAINER_DTYPE,
                        help=f"weight dtype of the memory estimate (default {TRAINER_DTYPE}: what the trainer builds)")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = compose_config(args.overrides)
        plan = build_plan(cfg, dtype=args.dtype)
    except ConfigError as err:
        print(f"mgrpo-plan: {err}", file=sys.stderr)
        sys.exit(2)
    except Exception as err:  # Hydra composition: unknown key, wrong type, missing group option
        if type(err).__module__.split(".")[0] not in ("hydra", "omegaconf"):
            raise
        cause = f" ({err.__cause__})" if err.__cause__ else ""
        print(f"mgrpo-plan: {err}{cause}", file=sys.stderr)
        sys.exit(2)
    try:
        print(json.dumps(plan, indent=1) if args.json else render(plan))
    except BrokenPipeError:  # `mgrpo-plan | head`
        sys.stdout = open(os.devnull, "w")


if __name__ == "__main__":
    main()
