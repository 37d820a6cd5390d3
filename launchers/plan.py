"""mgrpo-plan: the resource plan of a run and whether it fits, from mgrpo-train's overrides; starts nothing.

    mgrpo-plan                                            # the default CPU job
    mgrpo-plan actor.tp=2 trainer.n_gpus_per_node=4       # world, TP/PP/CP/DP, who sits where
    mgrpo-plan recipe=qwen3-8b-gsm8k-grpo trainer.nnodes=2  # FITS / DOES NOT FIT, and a change that fits
    mgrpo-plan recipe=qwen3-8b-gsm8k-grpo model.hf_path=/ckpt/Qwen3-8B  # the architecture of its config.json
    mgrpo-plan ... --gpu-mem-gb 141                       # another card (default 80 GiB)
    mgrpo-plan ... --json                                 # machine-readable
    mgrpo-plan <a veRL command line>                      # veRL keys are translated as mgrpo-train does
    mgrpo-plan --config-path=config --config-name=ppo_megatron_trainer.yaml <veRL keys>   # as veRL scripts pass them

It composes and validates the config as mgrpo-train does (an invalid config exits with status 2 and
the validator's message), except that data files need not exist yet. It prints: nodes x accelerators;
the trainer's world and its TP/PP/CP/DP split; which bundle (rank) goes to which node and local
accelerator; the rollout engines; the batch arithmetic of one step; and the memory of one accelerator
(mgrpo.plan.memory: weights, grads, optimizer states, reference, activations at the token
budget with and without recompute, the log-prob head's working set, weight-sync buckets, the colocated
SGLang share, the CUDA context) per phase of a step, in the dtype the trainer will use (bf16 weights with
fp32 master weights on cuda, fp32 on cpu), with the verdict: FITS, or DOES NOT FIT with the largest
term and the smallest change found that fits. mgrpo-train runs the same check before it starts anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional, Sequence

from mgrpo.config import ConfigError, Layout, MGRPOConfig, output_dir
from mgrpo.models.registry import param_counts  # the model family's count; imports no torch
from mgrpo.plan.rewards import render_reward_models, reward_model_plan
from mgrpo.preflight import preflight

GIB = 1024**3
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def compose_config(overrides: Sequence[str]) -> MGRPOConfig:
    """The typed config mgrpo-train would run with these overrides."""
    from hydra import compose, initialize_config_dir

    from mgrpo_launchers.train import CONFIG_DIR, to_config  # also registers the structured schema

    from mgrpo_launchers.overrides import shaped

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return to_config(compose(config_name="config", overrides=shaped(overrides)))


# --- memory ------------------------------------------------------------------------------------------
def hf_planning_config(cfg: MGRPOConfig, warnings: list) -> MGRPOConfig:
    """With model.hf_path, plan the architecture of its config.json (no weights are read); a model.*
    field that disagrees is a warning here and an error in mgrpo-train."""
    from dataclasses import replace

    from mgrpo.models.hf_config import hf_architecture

    try:
        arch = hf_architecture(cfg.model.hf_path)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"model.hf_path={cfg.model.hf_path!r}: {err}") from None
    for k, v in arch.items():
        if k not in ("name", "tokenizer") and getattr(cfg.model, k) != v:
            warnings.append(f"model.{k}={getattr(cfg.model, k)} but {cfg.model.hf_path}/config.json says {v}: planned "
                            f"with config.json; mgrpo-train refuses the mismatch (set model.{k}={v})")
    return replace(cfg, model=replace(cfg.model, **{k: v for k, v in arch.items() if k not in ("name", "tokenizer")}))


def memory_plan(cfg: MGRPOConfig, lay: Layout, *, dtype: Optional[str] = None,
                gpu_mem_gb: Optional[float] = None) -> dict:
    """Per-accelerator memory by phase, the verdict and a change that fits (mgrpo.plan.memory)."""
    from mgrpo.plan.memory import estimate, verdict
    from mgrpo.plan.memory import ALLOCATOR_SLACK
    from mgrpo.plan.offload import table as offload_table

    v = verdict(cfg, lay, gpu_mem_gb=gpu_mem_gb, dtype=dtype)
    m = v.memory
    shape = m.shape
    return {
        "device": m.device, "dtype": m.dtype, "layer_spec": m.spec, "heaviest_stage": m.stage,
        "params_per_rank": m.params,
        "micro_batch": {"tokens": shape.tokens, "sequences": shape.seqs, "sequence_length": shape.seq_len,
                        "response_tokens": shape.response_tokens, "in_flight_on_first_stage": shape.in_flight},
        "terms": m.terms,
        "activations_by_recompute": m.activations_by_recompute,
        "recompute": cfg.actor.recompute,
        "phases": {p: {**t, "total": sum(t.values())} for p, t in m.phases.items()},
        "capacity": m.capacity, "peak": m.peak, "peak_phase": m.peak_phase, "largest_term": list(m.largest),
        "fits": m.fits, "verdict": v.message(),
        "suggestion": v.suggestion, "suggested_peak": v.suggested.peak if v.suggested else None,
        **({"lora": lora_plan(cfg, lay, m, dtype=dtype, gpu_mem_gb=gpu_mem_gb)} if cfg.actor.lora.enabled else {}),
        "offload": offload_table(cfg, estimate, slack=ALLOCATOR_SLACK, gpu_mem_gb=gpu_mem_gb, dtype=dtype),
    }


LORA_TERMS = ("actor_weights", "actor_grads", "optimizer_states", "reference_weights")


def lora_plan(cfg: MGRPOConfig, lay: Layout, mem, *, dtype: Optional[str] = None,
              gpu_mem_gb: Optional[float] = None) -> dict:
    """The heaviest stage's persistent memory and peak with actor.lora against full fine-tuning of the same run."""
    from dataclasses import replace

    from mgrpo.config.schema import LoraConfig
    from mgrpo.plan.lora import adapter_counts
    from mgrpo.plan.memory import verdict

    full = verdict(replace(cfg, actor=replace(cfg.actor, lora=LoraConfig())), lay, gpu_mem_gb=gpu_mem_gb,
                   dtype=dtype).memory
    a = cfg.actor
    adapters = adapter_counts(cfg.model, a.lora, a.tp, a.pp, a.ep)[0][mem.stage]
    return {"rank": a.lora.rank, "adapter_params_per_rank": adapters,
            "lora": {k: mem.terms.get(k, 0) for k in LORA_TERMS} | {"peak": mem.peak},
            "full": {k: full.terms.get(k, 0) for k in LORA_TERMS} | {"peak": full.peak}}


def render_lora(lo: dict) -> list[str]:
    from mgrpo.plan.memory import LABELS

    out = [f"lora      rank {lo['rank']}: {lo['adapter_params_per_rank']:,} adapter params per rank; base frozen "
           f"(weights only), reference = base with adapters off",
           f"          {'':<48}{'LoRA':>12}{'full FT':>12}"]
    for k in (*LORA_TERMS, "peak"):
        out.append(f"          {LABELS.get(k, k):<48}{_size(lo['lora'][k]):>12}{_size(lo['full'][k]):>12}")
    return out


# --- placement and batch -----------------------------------------------------------------------------
def rank_coords(rank: int, tp: int, cp: int, dp: int) -> dict:
    """Megatron's default rank order 'tp-cp-ep-dp-pp': tp varies fastest, pp slowest."""
    return {"tp": rank % tp, "cp": rank // tp % cp, "dp": rank // (tp * cp) % dp, "pp": rank // (tp * cp * dp)}


def placement(cfg: MGRPOConfig, lay: Layout) -> tuple[list[dict], list[dict]]:
    """Megatron ranks and rollout engines on (node, local accelerator), in the order Ray's PACK strategy
    fills the nodes (Ray may pick other nodes; the grouping into nodes is what matters)."""
    a, r = cfg.actor, cfg.rollout
    per_node = lay.total // cfg.trainer.nnodes
    ranks = []
    for i in range(lay.megatron_world):
        c = rank_coords(i, a.tp, a.cp, lay.dp)
        role = []
        if c["tp"] == 0 and c["dp"] == 0 and c["cp"] == 0:
            role.append("weight source")
        if a.pp > 1 and c["pp"] == a.pp - 1:
            role.append("last stage")
        ranks.append({"rank": i, "node": i // per_node, "local": i % per_node, **c, "role": ", ".join(role)})
    first = 0 if r.shares_actor_devices else lay.megatron_world
    engines = []
    for e in range(lay.num_engines):
        slots = [first + e * r.tp + k for k in range(r.tp)]
        engines.append({"engine": e, "tp": r.tp, "accelerators": [[s // per_node, s % per_node] for s in slots],
                        "shares_with_trainer_ranks": [s for s in slots if s < lay.megatron_world]
                        if r.shares_actor_devices else []})
    return ranks, engines


def multi_turn_plan(cfg: MGRPOConfig, lay: Layout, samples: int) -> dict:
    """What a multi-turn step asks of the engines. Tool replies and template tokens count in
    data.max_response_length (mgrpo/agent/runner.py ends a trajectory as `length` when they would not fit), so
    the trainer's sequence bound is unchanged; what grows is the generation side: one request per assistant turn,
    each re-sending the accumulated context (SGLang's prefix cache serves the repeated part on the engine that
    holds it), and the KV cache of every trajectory in flight."""
    d, mt = cfg.data, cfg.rollout.multi_turn
    seq = d.max_prompt_length + d.max_response_length
    turns = mt.max_assistant_turns
    per_turn = min(mt.max_tokens_per_turn or d.max_response_length, d.max_response_length)
    in_flight = min(samples, mt.max_concurrent_per_engine * max(lay.num_engines, 1))
    out = {"max_assistant_turns": turns, "new_tokens_per_turn_at_most": per_turn,
           "generate_requests_per_step_at_most": samples * turns,
           "trajectories_in_flight_at_most": in_flight,
           "kv_tokens_in_flight_at_most": in_flight * seq,
           "prefill_tokens_per_trajectory_at_most": turns * seq,
           "warnings": []}
    if per_turn * turns < d.max_response_length // 2:
        out["warnings"].append(f"rollout.multi_turn: {turns} turn(s) x {per_turn} new tokens use at most "
                               f"{per_turn * turns} of data.max_response_length={d.max_response_length}: the rest "
                               "is left to tool replies")
    out["warnings"] += call_fit_warnings(cfg)
    return out


def call_fit_warnings(cfg: MGRPOConfig) -> list[str]:
    """The run's start-up check that a tool call fits an assistant turn, from the run's tokenizer and tools."""
    from mgrpo.agent.parse import call_cannot_fit
    from mgrpo.agent.tools import ToolSet, function_tools_strict
    from mgrpo.data import load_tokenizer

    mt = cfg.rollout.multi_turn
    try:
        tokenizer = load_tokenizer(cfg.model)
        tools = ToolSet.from_config(list(mt.function_tools), mt.tool_config_path,
                                    function_tools_strict(mt.tool_choice, mt.required_per_group,
                                                          mt.strict_function_tools))
    except Exception as e:  # the plan still prints; the run itself fails on this at start
        return [f"rollout.multi_turn: the tools or tokenizer did not load, so whether a call fits a turn is "
                f"unchecked: {type(e).__name__}: {e}"]
    why = call_cannot_fit(mt, tools, tokenizer, cfg.data.max_response_length)
    return [why] if why else []


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
    if r.multi_turn.enable:
        out["multi_turn"] = multi_turn_plan(cfg, lay, out["samples_per_step"])
        out["warnings"] += out["multi_turn"].pop("warnings")
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


def gpu_use(cfg: MGRPOConfig, lay: Layout) -> dict:
    """How many of the job's accelerators train, generate and score (reward engines with accelerators of their
    own; mgrpo/plan/rewards.py), the SGLang teacher's engines, and a warning for those idle in a phase."""
    r = cfg.rollout
    own = sum(m.engines * m.tp for m in cfg.reward.models.values() if m.placement == "own" and not m.url
              and not (m.kind == "generative" and m.judge.openai_url))
    t = cfg.teacher
    teacher = t.num_engines * t.tp if t.hf_path and t.mode == "sglang" else 0
    out = {"total": lay.total, "training": lay.megatron_world, "generation": lay.rollout_devices,
           "reward_engines": own, "teacher_engines": teacher, "warnings": []}
    if r.shares_actor_devices and lay.rollout_devices < lay.total:
        idle = lay.total - lay.rollout_devices
        fix = ("rollout.num_engines=null puts one on every rollout.tp GPUs"
               if r.num_engines is not None else f"a rollout.tp that divides the {lay.total} GPUs uses them all")
        out["warnings"].append(f"{idle} of the {lay.total} GPUs generate nothing: {lay.num_engines} engine(s) x "
                               f"rollout.tp {r.tp} = {lay.rollout_devices} ({fix})")
    if lay.megatron_world % (cfg.actor.tp * cfg.actor.pp * cfg.actor.cp):
        out["warnings"].append(f"{lay.megatron_world % (cfg.actor.tp * cfg.actor.pp * cfg.actor.cp)} GPU(s) train "
                               "nothing")
    return out


# --- the plan ----------------------------------------------------------------------------------------
def build_plan(cfg: MGRPOConfig, *, dtype: Optional[str] = None, gpu_mem_gb: Optional[float] = None) -> dict:
    """Validate (data files need not exist yet) and lay out a run; raises ConfigError like mgrpo-train."""
    lay = preflight(cfg, check_files=False, check_memory=False, check_placement=False).layout
    warnings: list[str] = []
    if cfg.model.hf_path:
        cfg = hf_planning_config(cfg, warnings)
    a, r, t, m = cfg.actor, cfg.rollout, cfg.trainer, cfg.model
    ranks, engines = placement(cfg, lay)
    counts = param_counts(m, a.tp, a.pp, a.ep)
    return {
        "output_dir": output_dir(cfg),
        "device": t.device,
        "cluster": {"nodes": t.nnodes, "accelerators_per_node": lay.total // t.nnodes, "accelerators": lay.total,
                    "cpus_per_worker": t.cpus_per_worker, "ray_address": t.ray_address,
                    # every Megatron rank and every engine is a Ray bundle of cpus_per_worker CPUs
                    "ray_cpus_needed": (lay.megatron_world + (0 if r.mode == "hybrid" else lay.num_engines))
                                       * t.cpus_per_worker},
        "trainer": {"world": lay.megatron_world, "tp": a.tp, "pp": a.pp, "cp": a.cp, "dp": lay.dp, "ep": a.ep,
                    "layers_per_stage": m.num_layers // a.pp, "ranks": ranks},
        "rollout": {"engine": r.engine, "mode": r.mode, "num_engines": lay.num_engines, "tp": r.tp,
                    "num_engines_set": r.num_engines is not None,
                    "accelerators": lay.rollout_devices, "engines": engines},
        "gpus": (gpus := gpu_use(cfg, lay)),
        "batch": (batch := batch_plan(cfg, lay)) | {"warnings": warnings + gpus["warnings"] + batch["warnings"]},
        "model": {"name": m.name, "params_hf": counts["hf_total"], "params_megatron": counts["megatron_total"],
                  "padded_vocab": counts["padded_vocab"], "params_per_layer": counts["layer"],
                  "params_per_rank_by_stage": counts["per_rank_by_stage"],
                  "expert_params": counts["expert_total"],
                  "expert_params_per_rank_by_stage": counts["expert_per_rank_by_stage"]},
        "memory_per_accelerator": (mem := memory_plan(cfg, lay, dtype=dtype, gpu_mem_gb=gpu_mem_gb)),
        "reward_models": reward_model_plan(cfg, lay, mem),
    }


def _fmt(n: float) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 1024**2:.2f} MiB"


def render_memory(me: dict) -> list[str]:
    from mgrpo.plan.memory import LABELS

    per = "GPU" if me["device"] == "cuda" else "rank"
    dtype = "bf16 weights, fp32 grads and master weights" if me["dtype"] == "bf16" else "fp32"
    spec = "Transformer Engine spec" if me["layer_spec"] == "te" else "local spec"
    mb = me["micro_batch"]
    out = [f"memory    per {per}, heaviest pipeline stage ({me['heaviest_stage']}): {me['params_per_rank']:,} params "
           f"per rank, {dtype}, {spec}; micro-batch {mb['tokens']:,} tokens ({mb['sequences']} x {mb['sequence_length']}), "
           f"{mb['in_flight_on_first_stage']} in flight"]
    phases = me["phases"]
    names = [k for k in LABELS if any(k in t for t in phases.values())]
    width = {p: max(12, len(p)) + 2 for p in phases}
    out.append("          " + f"{'':<48}" + "".join(f"{p:>{width[p]}}" for p in phases))
    for k in names:
        cells = "".join(f"{_size(phases[p][k]) if k in phases[p] else '':>{width[p]}}" for p in phases)
        out.append(f"          {LABELS[k]:<48}{cells}")
    out.append(f"          {'total':<48}" + "".join(f"{_size(phases[p]['total']):>{width[p]}}" for p in phases))
    act = me["activations_by_recompute"]
    out.append(f"          activations with recompute none / selective / full: {_size(act['None'])} / "
               f"{_size(act['selective'])} / {_size(act['full'])} "
               + f"(actor.recompute={me['recompute']})")
    out.append(f"verdict   {me['verdict']}")
    if "lora" in me:
        out.extend(render_lora(me["lora"]))
    return out + render_offload(me.get("offload"))


def render_offload(o: Optional[dict]) -> list[str]:
    """actor.offload: the trainer's bytes per phase with each choice, and the engines' KV-cache tokens."""
    if not o:
        return []
    rows = o["choices"]
    phases = list(next(iter(rows.values()))["trainer_by_phase"])
    out = [f"offload   actor + reference per GPU by phase with actor.offload (engines excluded); KV cache "
           f"{o['kv_bytes_per_token'] / 1024:.0f} KiB/token, engine weights {_size(o['engine_weights_per_gpu'])}/GPU, "
           f"{o['kv_tokens_at_configured_share']:,} tokens at rollout.gpu_memory_utilization={o['configured_share']}"]
    width = {p: max(12, len(p)) + 2 for p in phases}
    out.append(f"          {'':<14}" + "".join(f"{p:>{width[p]}}" for p in phases)
               + f"{'peak':>18}  {'engine share':>12} {'KV tokens':>12} {'vs none':>11}")
    for name, row in rows.items():
        cells = "".join(f"{_size(row['trainer_by_phase'][p]):>{width[p]}}" for p in phases)
        verdict = ("FITS" if row["fits"] else "NO FIT")
        out.append(f"          {name:<14}{cells}{_size(row['peak']):>11} {verdict:>6}  "
                   f"{row['largest_engine_share']:>12.3f} {row['kv_tokens_at_largest_share']:>12,} "
                   f"{row['kv_tokens_more_than_none']:>+11,}")
    out.append("          (engine share: the largest rollout.gpu_memory_utilization that fits while the engines "
               "generate; KV tokens per engine GPU at it)")
    return out


def _unset_engines(mode: str, device: str) -> str:
    if mode == "disaggregated" or device != "cuda":
        return f" (rollout.num_engines unset: 1, {'disaggregated' if mode == 'disaggregated' else 'on CPU'})"
    return " (rollout.num_engines unset: one per rollout.tp GPUs of the job)"


def render(p: dict) -> str:
    c, tr, ro, b, mo, me = p["cluster"], p["trainer"], p["rollout"], p["batch"], p["model"], p["memory_per_accelerator"]
    acc = "GPUs" if p["device"] == "cuda" else "CPU bundles" if p["device"] == "cpu" else "accelerators"
    out = [f"mgrpo plan (nothing started)   output_dir: {p['output_dir']}",
           f"cluster   {c['nodes']} node(s) x {c['accelerators_per_node']} {acc} = {c['accelerators']}  "
           f"(trainer.device={p['device']}; Ray needs {c['ray_cpus_needed']} CPUs: "
           f"{tr['world']} rank(s) + {ro['num_engines']} engine(s) x {c['cpus_per_worker']})",
           f"trainer   world {tr['world']} = tp {tr['tp']} x pp {tr['pp']} x cp {tr['cp']} x dp {tr['dp']}  "
           f"({tr['layers_per_stage']} layer(s) per pipeline stage)"
           + (f"; experts split over ep {tr['ep']} (expert data parallel {tr['world'] // tr['pp'] // tr['ep']})"
              if mo["expert_params"] else "")]
    if ro["mode"] == "colocated":
        where = "colocated: shares the actor's accelerators (memory released while training)"
    elif ro["mode"] == "hybrid":
        where = "hybrid: inside the Megatron ranks' processes, on their accelerators (memory released while training)"
    else:
        where = f"disaggregated: its own {ro['accelerators']} accelerator(s) after the trainer's"
    out.append(f"rollout   {ro['num_engines']} {ro['engine']} engine(s) x tp {ro['tp']} = {ro['accelerators']} "
               f"accelerator(s), {where}{'' if ro['num_engines_set'] else _unset_engines(ro['mode'], p['device'])}")
    g = p["gpus"]
    out.append(f"{acc:<10}{g['training']} of {g['total']} train, {g['generation']} of {g['total']} generate, "
               + (f"{g['reward_engines']} more score (reward engines)" if g["reward_engines"] else
                  "no reward engines of their own")
               + (f", {g['teacher_engines']} more for the teacher's engines" if g["teacher_engines"] else ""))
    out.append("")
    out.append("placement (rank = Megatron bundle; Ray's PACK strategy fills nodes in this order)")
    out.append("  rank  node  local    tp  pp  cp  dp  role")
    for r in tr["ranks"]:
        out.append(f"  {r['rank']:>4}  {r['node']:>4}  {r['local']:>5}  {r['tp']:>4}{r['pp']:>4}{r['cp']:>4}"
                   f"{r['dp']:>4}  {r['role']}")
    for e in ro["engines"]:
        accs = " ".join(f"{n}:{i}" for n, i in e["accelerators"])
        share = f" (with Megatron ranks {', '.join(map(str, e['shares_with_trainer_ranks']))})" \
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
    if "multi_turn" in b:
        mt = b["multi_turn"]
        out.append(f"multi-turn up to {mt['max_assistant_turns']} assistant turn(s) of <= {mt['new_tokens_per_turn_at_most']} "
                   f"new tokens; tool replies count in the response budget; <= {mt['generate_requests_per_step_at_most']:,} "
                   f"generate requests per step, <= {mt['trajectories_in_flight_at_most']} trajectories in flight "
                   f"(<= {mt['kv_tokens_in_flight_at_most']:,} KV tokens), each re-sending <= "
                   f"{mt['prefill_tokens_per_trajectory_at_most']:,} prompt tokens over its turns")
    out += [f"  warning: {w}" for w in b["warnings"]]
    out.append("")
    out += render_reward_models(p["reward_models"], p["device"])
    out.append(f"model     {mo['name']}: {_fmt(mo['params_hf'])} params ({mo['params_hf']:,} in HF layout; "
               f"{mo['params_megatron']:,} in megatron with the vocabulary padded to {mo['padded_vocab']:,})")
    out += render_memory(me)
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="mgrpo-plan", description=__doc__.split("\n\n")[0],
                                     epilog="Overrides are the same as mgrpo-train's, e.g. actor.tp=2 model=qwen3-8b.")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (key=value, group=option)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                        help="weight dtype of the memory estimate (default: what the trainer will use, "
                             "bf16 on cuda and fp32 on cpu unless actor.dtype says otherwise)")
    parser.add_argument("--gpu-mem-gb", type=float, default=None,
                        help="memory of one GPU in GiB (default trainer.gpu_memory_gb if set, else 80)")
    # veRL scripts pass these to veRL's trainer; mgrpo-train and mgrpo-plan read them the same way (the
    # translation table says what they are taken to mean).
    parser.add_argument("--config-path", "-cp", default=None, help="veRL's --config-path (accepted with "
                        "--config-name of one of veRL's trainer configs; mgrpo composes configs/config.yaml)")
    parser.add_argument("--config-name", "-cn", default=None, help="veRL's --config-name: ppo_trainer, "
                        "ppo_megatron_trainer, dapo_trainer or dapo_megatron_trainer")
    from mgrpo.compat import slime

    try:  # slime's flags first: argparse would refuse them
        from_slime = slime.translate(sys.argv[1:] if argv is None else argv,
                                     own={"--json": False, "--dtype": True, "--gpu-mem-gb": True})
    except ConfigError as err:
        print(f"mgrpo-plan: {err}", file=sys.stderr)
        sys.exit(2)
    if from_slime.rows:
        print(f"mgrpo-plan: {slime.render(from_slime)}", file=sys.stderr)
    args = parser.parse_intermixed_args(from_slime.args)
    flags = [f"--config-path={args.config_path}"] * (args.config_path is not None) + \
        [f"--config-name={args.config_name}"] * (args.config_name is not None)
    try:
        from mgrpo.compat.verl import translate

        translation = translate(flags + args.overrides)
        if translation.is_verl:
            print(f"mgrpo-plan: {translation.render()}", file=sys.stderr)
        left = [a for a in translation.args if a.startswith("-")]
        if left:
            raise ConfigError(f"{' '.join(left)}: mgrpo-plan composes mgrpo's configs/config.yaml; --config-name is "
                              "understood only as one of veRL's trainer configs (ppo_trainer, ppo_megatron_trainer, "
                              "dapo_trainer, dapo_megatron_trainer)")
        cfg = compose_config(translation.args)
        plan = build_plan(cfg, dtype=args.dtype, gpu_mem_gb=args.gpu_mem_gb)
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
