"""Field-local checks of a config: types, ranges, closed choices, sizes that must divide, files that must exist.

Every message names the field and its value (`actor.tp=3 does not divide model.num_attention_heads=4`) so a
user can fix the command line without reading code. This module knows nothing above `mgrpo.config`: the
checks that ask a room (registered names and their metadata, data sources, kernels, the memory plan) are
in `mgrpo/preflight.py`, which runs these first and reports every problem of both in one error.
Capability checks that depend on the machine (Triton, Transformer Engine, SGLang, a GPU) happen at call
time where the feature is used.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, replace

from mgrpo.config.checks import (choice, divides, multi_turn_errors, positive, reward_model_errors, sandbox_errors,
                                 stop_errors)
from mgrpo.config.choices import (CP_COMM_TYPES, AsyncMode, Device, Dtype, Engine, Fp8Format, Fp8Recipe, Logger,
                                  LogprobImpl, LogprobSupport, LrDecayStyle, Recompute, RolloutMode, RouterReplay,
                                  SmallGroup, is_choice, plain)
from mgrpo.config.lora import adapter_sync_problem, check_lora
from mgrpo.config.registry import target_error
from mgrpo.config.schema import MGRPOConfig

RESUME_MODES = ("auto", "disable", "force")
"""trainer.resume values other than a checkpoint directory (veRL's resume_mode words, and force)."""
RESUME_ALIASES = ("off",)
"""Read as disable (accepted, never suggested)."""


class InputError(ValueError):
    """Bad input from the user (a config, a data file, a checkpoint): the message names the file, line and field
    or the config key. The launchers print it in a line or two and exit 2; a traceback is for mgrpo's own bugs."""


class ConfigError(InputError):
    """A configuration that cannot run; the message names the offending field(s)."""


@dataclass(frozen=True)
class Layout:
    """How the accelerators (CPU bundles on CPU) are split, derived from a validated config."""

    total: int
    megatron_world: int
    """Megatron ranks (the actor and its reference live in the same processes)."""
    rollout_devices: int
    dp: int
    num_engines: int = 1
    """rollout.num_engines, or what it means unset (`engine_count`)."""


def layout(cfg: MGRPOConfig) -> Layout:
    """Megatron world size and data-parallel size. Assumes `field_errors(cfg)` is empty."""
    a, r = cfg.actor, cfg.rollout
    model_parallel = a.tp * a.pp * a.cp
    total = accelerators(cfg)
    engines = engine_count(cfg, total)
    rollout_devices = engines * r.tp
    world = total - rollout_devices if r.mode == RolloutMode.disaggregated else total
    return Layout(total, world, rollout_devices, max(world // model_parallel, 1), engines)


def accelerators(cfg: MGRPOConfig) -> int:
    """The job's accelerators: trainer.nnodes x n_gpus_per_node; with n_gpus_per_node unset, one model replica
    per node, or as many ranks as expert parallelism needs (its ranks come out of tp x cp x dp)."""
    a, t = cfg.actor, cfg.trainer
    fewest = a.pp * math.lcm(a.tp * a.cp, max(a.ep, 1)) if min(a.tp, a.cp, a.pp) > 0 else a.tp * a.pp * a.cp
    return t.nnodes * (t.n_gpus_per_node if t.n_gpus_per_node is not None else fewest)


def engine_count(cfg: MGRPOConfig, total: int) -> int:
    """rollout.num_engines, or unset: one engine on every rollout.tp of the job's `total` GPUs when the engines
    share them (colocated, hybrid; veRL's rule, verl/experimental/agent_loop/agent_loop.py: world_size // TP),
    else 1 (disaggregated engines take GPUs from the trainer, so how many is the user's call; on CPU more
    engines would only share the same cores). 0 when rollout.tp exceeds the GPUs (the validator says so)."""
    r = cfg.rollout
    if r.num_engines is not None:
        return r.num_engines
    if r.mode == RolloutMode.disaggregated or resolved_device(cfg.trainer.device) != Device.cuda:
        return 1
    return total // max(r.tp, 1)


# --- by group ---------------------------------------------------------------------------------------
def _model(cfg: MGRPOConfig) -> list[str]:
    e: list[str] = []
    m = cfg.model
    positive(e, "model", m, ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                              "head_dim", "ffn_hidden_size", "max_position_embeddings"))
    if m.num_query_groups > 0:
        divides(e, "model.num_query_groups", m.num_query_groups, "model.num_attention_heads", m.num_attention_heads)
    if m.hf_path is not None and not os.path.isfile(os.path.join(m.hf_path, "config.json")):
        hub_id = m.hf_path.count("/") == 1 and not os.path.exists(m.hf_path)
        hint = (f"; it looks like a Hugging Face hub id, and mgrpo never downloads at run time: "
                f"`huggingface-cli download {m.hf_path} --local-dir DIR`, then model.hf_path=DIR") if hub_id else ""
        e.append(f"model.hf_path={m.hf_path!r}: no config.json there{hint}")
    return e


def _actor(cfg: MGRPOConfig) -> list[str]:
    e: list[str] = []
    m, d, a, t = cfg.model, cfg.data, cfg.actor, cfg.trainer
    divides(e, "actor.tp", a.tp, "model.num_attention_heads", m.num_attention_heads)
    divides(e, "actor.tp", a.tp, "model.num_query_groups", m.num_query_groups)
    if not m.num_experts:  # a MoE model has no dense MLP to split, and TP never splits its experts
        divides(e, "actor.tp", a.tp, "model.ffn_hidden_size", m.ffn_hidden_size)
    divides(e, "actor.pp", a.pp, "model.num_layers", m.num_layers)
    if a.ep < 1:
        e.append(f"actor.ep={a.ep} must be positive")
    elif a.ep > 1 and not m.num_experts:
        e.append(f"actor.ep={a.ep} splits experts, but model.num_experts=0 (model.family={m.family!r} is dense)")
    elif m.num_experts:
        divides(e, "actor.ep", a.ep, "model.num_experts", m.num_experts)
    if a.cp < 1:
        e.append(f"actor.cp={a.cp} must be positive")
    choice(e, "actor.cp_comm_type", a.cp_comm_type, CP_COMM_TYPES)
    if a.recompute is not None:
        choice(e, "actor.recompute", a.recompute, Recompute)
    if a.cp > 1 and a.cp_comm_type in ("a2a", "a2a+p2p") and (m.num_attention_heads // max(a.tp, 1)) % a.cp:
        e.append(f"actor.cp_comm_type={a.cp_comm_type!r} splits each rank's attention heads over CP ranks: "
                 f"model.num_attention_heads/actor.tp={m.num_attention_heads // max(a.tp, 1)} is not divisible by "
                 f"actor.cp={a.cp} (use actor.cp_comm_type=p2p)")
    if a.fp8 is not None:
        choice(e, "actor.fp8", a.fp8, Fp8Format)
    choice(e, "actor.fp8_recipe", a.fp8_recipe, Fp8Recipe)
    if a.fp8 is not None and t.device == Device.cpu:
        e.append(f"actor.fp8='{a.fp8!s}' needs Transformer Engine on a GPU; on trainer.device=cpu use actor.fp8=null")
    if a.use_distributed_optimizer and t.device == Device.cpu:
        e.append("actor.use_distributed_optimizer=True needs CUDA tensors in megatron-core; "
                 "on trainer.device=cpu use actor.use_distributed_optimizer=false")
    choice(e, "actor.logprob_impl", a.logprob_impl, LogprobImpl)
    if a.logprob_chunk_size < 1 or (a.logprob_chunk_mb is not None and a.logprob_chunk_mb <= 0):
        e.append(f"actor.logprob_chunk_size={a.logprob_chunk_size} and actor.logprob_chunk_mb={a.logprob_chunk_mb} "
                 "must be positive (logprob_chunk_mb=null: no cap)")
    choice(e, "actor.router_replay", a.router_replay, RouterReplay)  # which families route: preflight
    lora_problem = check_lora(a.lora, num_experts=m.num_experts)
    if lora_problem:
        e.append(lora_problem)
    elif a.lora.enabled and a.lora.sync == "adapter":
        why = adapter_sync_problem(a.lora, engine=cfg.rollout.engine, num_experts=m.num_experts)
        if why:
            e.append(f"actor.lora.sync=adapter cannot be used: {why}; use actor.lora.sync=merged (or auto)")
    choice(e, "actor.dtype", a.dtype, Dtype)
    if a.dtype == Dtype.bf16 and t.device == Device.cpu:
        e.append("actor.dtype=bf16 needs CUDA (megatron's mixed-precision optimizer); on trainer.device=cpu "
                 "use actor.dtype=fp32")
    choice(e, "actor.lr_decay_style", a.lr_decay_style, LrDecayStyle)
    if a.lr <= 0:
        e.append(f"actor.lr={a.lr} must be positive")
    if a.ppo_epochs < 1:
        e.append(f"actor.ppo_epochs={a.ppo_epochs} must be at least 1")
    one_sequence = d.max_prompt_length + d.max_response_length
    if 0 < a.max_tokens_per_gpu < one_sequence:
        e.append(f"actor.max_tokens_per_gpu={a.max_tokens_per_gpu} is smaller than one sequence "
                 f"(data.max_prompt_length + data.max_response_length = {one_sequence})")
    if a.ppo_mini_batch_size is not None:
        divides(e, "actor.ppo_mini_batch_size", a.ppo_mini_batch_size, "data.train_batch_size", d.train_batch_size)
    return e


def _resources(cfg: MGRPOConfig) -> list[str]:
    e: list[str] = []
    a, r, t = cfg.actor, cfg.rollout, cfg.trainer
    choice(e, "trainer.device", t.device, Device)
    choice(e, "rollout.engine", r.engine, Engine)
    choice(e, "rollout.mode", r.mode, RolloutMode)
    if t.nnodes < 1:
        e.append(f"trainer.nnodes={t.nnodes} must be at least 1")
    if t.n_gpus_per_node is not None and t.n_gpus_per_node < 1:
        e.append(f"trainer.n_gpus_per_node={t.n_gpus_per_node} must be at least 1")
    if (r.num_engines is not None and r.num_engines < 1) or r.tp < 1:
        e.append(f"rollout.num_engines={r.num_engines} and rollout.tp={r.tp} must be at least 1")
    if r.engine == Engine.sglang and r.mode == RolloutMode.disaggregated and a.pp > 1:
        e.append("rollout.mode=disaggregated with actor.pp>1: the per-stage NCCL weight broadcasts are not "
                 "serialised yet; use actor.pp=1 or rollout.mode=colocated")
    if e or min(a.tp, a.pp, a.cp, a.ep) < 1:
        return e
    lay = layout(cfg)
    mp = a.tp * a.pp * a.cp
    if lay.num_engines < 1:
        e.append(f"rollout.tp={r.tp} is larger than the job's {lay.total} GPUs (trainer.nnodes*trainer.n_gpus_per_node): "
                 "no engine fits (lower rollout.tp)")
    elif lay.megatron_world < 1:
        e.append(f"rollout.num_engines*rollout.tp={lay.rollout_devices} leaves no accelerator for the actor "
                 f"out of trainer.nnodes*trainer.n_gpus_per_node={lay.total}")
    elif lay.megatron_world % mp != 0:
        e.append(f"actor.tp*actor.pp*actor.cp={mp} does not divide the trainer's {lay.megatron_world} accelerators "
                 f"(trainer.nnodes*trainer.n_gpus_per_node"
                 f"{' - rollout.num_engines*rollout.tp' if r.mode == RolloutMode.disaggregated else ''})")
    elif (lay.megatron_world // a.pp) % a.ep != 0:  # expert ranks are carved out of tp x cp x dp
        e.append(f"actor.ep={a.ep} does not divide the {lay.megatron_world // a.pp} ranks of a pipeline stage "
                 f"(actor.tp*actor.cp*data-parallel = {a.tp}*{a.cp}*{lay.dp}); expert-parallel ranks are "
                 "carved out of them")
    if r.shares_actor_devices and lay.rollout_devices > lay.total:
        e.append(f"rollout.num_engines*rollout.tp={lay.rollout_devices} exceeds the {lay.total} accelerators"
                 + (" (rollout.mode=hybrid: each engine lives in a Megatron rank)"
                    if r.mode == RolloutMode.hybrid else ""))
    return e


def _data(cfg: MGRPOConfig, check_files: bool) -> list[str]:
    e: list[str] = []
    d, m = cfg.data, cfg.model
    for key in ("train_files", "val_files"):
        for i, f in enumerate(getattr(d, key)):
            if check_files and not os.path.exists(f):
                e.append(f"data.{key}[{i}]={f!r} does not exist")
            elif not f.endswith((".jsonl", ".json", ".parquet")):
                e.append(f"data.{key}[{i}]={f!r} is neither .jsonl nor .parquet")
    positive(e, "data", d, ("max_prompt_length", "max_response_length", "train_batch_size"))
    if d.max_prompt_length + d.max_response_length > m.max_position_embeddings:
        e.append(f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length} "
                 f"exceeds model.max_position_embeddings={m.max_position_embeddings}")
    return e


def _algorithm(cfg: MGRPOConfig) -> list[str]:
    e: list[str] = []
    al, d = cfg.algorithm, cfg.data
    choice(e, "algorithm.logprob_support", al.logprob_support, LogprobSupport)
    if al.clip_ratio_low < 0 or al.clip_ratio_high < 0:
        e.append(f"algorithm.clip_ratio_low={al.clip_ratio_low} and clip_ratio_high={al.clip_ratio_high} "
                 "must be non-negative")
    if al.clip_ratio_c is not None and al.clip_ratio_c <= 1.0:
        e.append(f"algorithm.clip_ratio_c={al.clip_ratio_c} must be greater than 1 (dual-clip bound)")
    if al.tis_cap is not None and al.tis_cap <= 0:
        e.append(f"algorithm.tis_cap={al.tis_cap} must be positive")
    if al.kl_coef < 0:
        e.append(f"algorithm.kl_coef={al.kl_coef} must be non-negative")
    if al.overlong_buffer.enable and not 0 < al.overlong_buffer.len <= d.max_response_length:
        e.append(f"algorithm.overlong_buffer.len={al.overlong_buffer.len} must be in "
                 f"1..data.max_response_length={d.max_response_length}")
    return e


def _rollout(cfg: MGRPOConfig) -> list[str]:
    e: list[str] = []
    r, ev, rw = cfg.rollout, cfg.evaluation, cfg.reward
    if r.n < 1:
        e.append(f"rollout.n={r.n} must be at least 1")
    if r.temperature <= 0:
        e.append(f"rollout.temperature={r.temperature} must be positive for training rollouts "
                 "(use evaluation.temperature=0 for greedy validation)")
    if not 0 < r.top_p <= 1:
        e.append(f"rollout.top_p={r.top_p} must be in (0, 1]")
    e += stop_errors(r.stop, r.stop_regex)
    if r.stop_regex and r.engine == Engine.sglang and engine_count(cfg, accelerators(cfg)) > 1:
        e.append("rollout.stop_regex cannot go through SGLang's router, which fronts more than one engine "
                 "(sglang-router 0.3.2 drops the field): use rollout.stop, one engine, or rollout.engine=hf")
    if r.ep < 1 or (r.ep > 1 and r.ep != r.tp):  # SGLang: ep_size * moe_dp_size == tp_size (moe_dp_size 1)
        e.append(f"rollout.ep={r.ep}: SGLang's expert-parallel size must be 1 or rollout.tp ({r.tp})")
    if not r.api_key or (r.api_key.startswith("env:") and not os.environ.get(r.api_key[4:])):
        e.append(f"rollout.api_key={r.api_key!r}: auto | none | env:<VARIABLE> (set and non-empty) | a key")
    if r.health_check_interval_s <= 0 or r.health_check_timeout_s <= 0:
        e.append(f"rollout.health_check_interval_s={r.health_check_interval_s} and rollout.health_check_timeout_s="
                 f"{r.health_check_timeout_s} must be positive")
    if not 0.0 <= r.over_sample_rate < 1.0:
        e.append(f"rollout.over_sample_rate={r.over_sample_rate} must be in [0, 1): the share of a step's "
                 "trajectories cut as the long tail")
    elif r.over_sample_rate > 0 and not r.multi_turn.enable:
        e.append(f"rollout.over_sample_rate={r.over_sample_rate} cuts the long tail of multi-turn rollouts (as veRL's, "
                 "whose single-turn path ignores it); set rollout.multi_turn.enable=true or drop the key")
    if not is_choice(r.async_mode, AsyncMode):
        choice(e, "rollout.async_mode", r.async_mode, AsyncMode)
    elif r.async_mode != AsyncMode.off:
        if r.shares_actor_devices:
            e.append(f"rollout.async_mode='{r.async_mode!s}' overlaps generation with training, which rollout.mode="
                     f"{r.mode!s} engines cannot (they release their accelerators while the actor trains); use "
                     "rollout.mode=disaggregated")
        if r.max_staleness < 1:
            e.append(f"rollout.max_staleness={r.max_staleness} must be at least 1 with rollout.async_mode="
                     f"'{r.async_mode!s}'")
    if ev.n < 1:
        e.append(f"evaluation.n={ev.n} must be at least 1")
    if ev.temperature < 0:
        e.append(f"evaluation.temperature={ev.temperature} must be non-negative")
    if rw.timeout_s <= 0:
        e.append(f"reward.timeout_s={rw.timeout_s} must be positive")
    f = rw.failed
    if f.min_group_size < 1 or f.rejudge_attempts < 0:
        e.append(f"reward.failed.min_group_size={f.min_group_size} must be at least 1 and "
                 f"reward.failed.rejudge_attempts={f.rejudge_attempts} non-negative")
    if not is_choice(f.small_group, SmallGroup):
        choice(e, "reward.failed.small_group", f.small_group, SmallGroup)
    for name in ("warn_rate", "max_rate"):
        if not 0 <= getattr(f, name) <= 1:
            e.append(f"reward.failed.{name}={getattr(f, name)} must be in [0, 1]")
    e += reward_model_errors(rw)
    for src, spec in rw.custom_functions.items():
        problem = target_error(spec, f"reward.custom_functions[{src!r}]", "function")
        if problem:
            e.append(problem)
    e += multi_turn_errors(r.multi_turn, cfg.model.tokenizer, r.n)
    o = cfg.actor.offload
    if o.actor_any and not r.shares_actor_devices:  # the reference's offload also frees memory for the update
        on = ", ".join(f"actor.offload.{k}" for k in ("params", "grads", "optimizer") if getattr(o, k))
        e.append(f"{on}: the actor hands its memory to engines on its accelerators while they generate; "
                 f"rollout.mode={r.mode!s} engines have accelerators of their own (set them false, or use "
                 "rollout.mode=colocated)")
    return e


def _trainer(cfg: MGRPOConfig) -> list[str]:
    e: list[str] = []
    t = cfg.trainer
    if t.total_training_steps is not None and t.total_training_steps < 1:
        e.append(f"trainer.total_training_steps={t.total_training_steps} must be at least 1 (or null)")
    for name in t.logger:
        choice(e, "trainer.logger[]", name, Logger)
    if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 1:
        e.append(f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep} must be at least 1 (or null to keep all)")
    if t.max_logprob_diff is not None and not t.max_logprob_diff > 0:
        e.append(f"trainer.max_logprob_diff={t.max_logprob_diff} must be positive (or null: by the actor's dtype)")
    if t.logprob_diff_patience < 0:
        e.append(f"trainer.logprob_diff_patience={t.logprob_diff_patience} must be at least 0 (0: no guard)")
    if t.resume not in RESUME_MODES + RESUME_ALIASES and not os.path.isdir(t.resume):
        e.append(f"trainer.resume={t.resume!r} is neither one of {list(RESUME_MODES)} nor a checkpoint directory")
    return e


def field_errors(cfg: MGRPOConfig, *, check_files: bool = True) -> list[str]:
    """Every field-local problem of `cfg` (an empty list when there is none)."""
    return (_model(cfg) + _actor(cfg) + _resources(cfg) + _data(cfg, check_files) + _algorithm(cfg)
            + _rollout(cfg) + sandbox_errors(cfg.sandbox) + _trainer(cfg))


def raise_errors(errors: list[str]) -> None:
    if len(errors) == 1:
        raise ConfigError(f"invalid configuration: {errors[0]}")
    if errors:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(errors))


def validate(cfg: MGRPOConfig, *, check_files: bool = True) -> Layout:
    """The field-local checks alone (ConfigError listing every problem); the resource layout otherwise.
    A run is checked by `mgrpo.preflight.preflight`, which adds the checks that ask the rooms.
    check_files=False skips the existence of data files (mgrpo-plan plans before the data is there)."""
    raise_errors(field_errors(cfg, check_files=check_files))
    return layout(cfg)


def resolve_device(cfg: MGRPOConfig) -> MGRPOConfig:
    """Resolve the 'auto' choices (a new config; the input is untouched): trainer.device becomes cuda
    when a GPU is visible, else cpu; actor.dtype becomes bf16 on cuda, fp32 on cpu; trainer.output_dir
    becomes absolute (Ray workers do not share the driver's working directory); asynchronous rollout
    turns on truncated importance sampling (algorithm.tis_cap=2.0) unless a cap is set; an unset
    rollout.num_engines becomes its number (`engine_count`); closed choices become plain strings (`choices.plain`)."""
    cfg = plain(cfg)
    device = resolved_device(cfg.trainer.device)
    algorithm = cfg.algorithm
    if cfg.rollout.num_engines is None:  # from here on every part reads a number
        cfg = replace(cfg, rollout=replace(cfg.rollout, num_engines=engine_count(cfg, accelerators(cfg))))
    if cfg.rollout.async_mode != AsyncMode.off and algorithm.tis_cap is None:
        algorithm = replace(algorithm, tis_cap=2.0)
    return replace(cfg, trainer=replace(cfg.trainer, device=device, output_dir=os.path.abspath(output_dir(cfg))),
                   actor=replace(cfg.actor, dtype=default_dtype(cfg.actor.dtype, device)), algorithm=algorithm)


def resolved_device(device: str) -> str:
    """trainer.device with 'auto' resolved: cuda when this process can use an NVIDIA GPU, else cpu. torch
    answers when the process has imported it (the driver); otherwise the device nodes do, so the planner
    never imports torch for it."""
    if device != Device.auto:
        return device
    torch = sys.modules.get("torch")
    if torch is not None:
        return Device.cuda if torch.cuda.is_available() else Device.cpu
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    nodes = os.path.exists("/dev/nvidia0") or os.path.isdir("/proc/driver/nvidia/gpus")
    return Device.cuda if nodes and visible not in ("", "-1") else Device.cpu


def default_dtype(dtype: str, device: str) -> str:
    """actor.dtype with 'auto' resolved for `device`: bf16 on cuda (fp32 master weights), fp32 on cpu."""
    if dtype != Dtype.auto:
        return dtype
    return Dtype.bf16 if device == Device.cuda else Dtype.fp32


def output_dir(cfg: MGRPOConfig) -> str:
    t = cfg.trainer
    return t.output_dir or os.path.join("outputs", t.project_name, t.experiment_name)
