"""The one place where a config is checked as a whole.

Every message names the field and its value (`actor.tp=3 does not divide model.num_attention_heads=4`)
so a user can fix the command line without reading code. Runs in the driver before any process is
spawned. Capability checks that depend on the machine (is Triton / Transformer Engine / SGLang
importable, is there a GPU) happen at call time where the feature is used, not here.

Named choices (estimators, losses, model families, synthetic tasks, ...) are checked against the
registries of the rooms that implement them, so a name is declared in one place. Those registries
import mgrpo.config themselves, so they are imported inside `validate` (the dependency keeps pointing
at config), and they import no torch (the planner validates without torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from mgrpo.config.schema import MGRPOConfig

# mgrpo_kernels.IMPLS (test_config checks they agree): the kernels import torch, the planner must not.
LOGPROB_IMPLS = ("chunked", "fused", "naive")
ROLLOUT_ENGINES = ("hf", "sglang")
ROLLOUT_MODES = ("colocated", "hybrid", "disaggregated")
DEVICES = ("auto", "cpu", "cuda")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
LOGGERS = ("console", "tensorboard")
DTYPES = ("auto", "bf16", "fp32")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")  # TransformerConfig.cp_comm_type (TE's CP exchange)


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the offending field(s)."""


@dataclass(frozen=True)
class Layout:
    """How the accelerators (CPU bundles on CPU) are split, derived from a validated config."""

    total: int
    trainer_world: int
    rollout_devices: int
    dp: int


def _choice(errors: list[str], name: str, value, allowed) -> None:
    if value not in allowed:
        errors.append(f"{name}={value!r} is not one of {list(allowed)}")


def _registered(errors: list[str], name: str, value, registry):
    """The registry entry of `value`, or None after recording the error (which lists the registered names)."""
    message = registry.unknown(value, key=name)
    if message is not None:
        errors.append(message)
        return None
    return registry[value]


def _divides(errors: list[str], a_name: str, a: int, b_name: str, b: int) -> None:
    if a <= 0:
        errors.append(f"{a_name}={a} must be positive")
    elif b % a != 0:
        errors.append(f"{a_name}={a} does not divide {b_name}={b}")


def layout(cfg: MGRPOConfig) -> Layout:
    """Trainer world size and data-parallel size. Assumes `validate` passed."""
    a, t, r = cfg.actor, cfg.trainer, cfg.rollout
    model_parallel = a.tp * a.pp * a.cp
    per_node = t.n_gpus_per_node if t.n_gpus_per_node is not None else model_parallel
    total = t.nnodes * per_node
    rollout_devices = r.num_engines * r.tp
    trainer_world = total - rollout_devices if r.mode == "disaggregated" else total
    return Layout(total, trainer_world, rollout_devices, max(trainer_world // model_parallel, 1))


def validate(cfg: MGRPOConfig, *, check_files: bool = True) -> Layout:
    """Raise ConfigError listing every problem found; return the resource layout otherwise.
    check_files=False skips the existence of data files (mgrpo-plan plans before the data is there)."""
    from mgrpo.algorithms.registry import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES
    from mgrpo.data.synthetic import SYNTHETIC_TASKS
    from mgrpo.models.capability import FP8_FORMATS, FP8_RECIPES
    from mgrpo.models.registry import FAMILIES
    from mgrpo.rewards.registry import BUILTIN_REWARDS, spec_error

    e: list[str] = []
    m, d, al, a, r, rw, ev, t = (cfg.model, cfg.data, cfg.algorithm, cfg.actor, cfg.rollout,
                                 cfg.reward, cfg.evaluation, cfg.trainer)

    # --- model shape ---------------------------------------------------------------------------
    _registered(e, "model.family", m.family, FAMILIES)
    for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                 "head_dim", "ffn_hidden_size", "max_position_embeddings"):
        if getattr(m, name) <= 0:
            e.append(f"model.{name}={getattr(m, name)} must be positive")
    if m.num_query_groups > 0:
        _divides(e, "model.num_query_groups", m.num_query_groups,
                 "model.num_attention_heads", m.num_attention_heads)
    if m.hf_path is not None and not os.path.isfile(os.path.join(m.hf_path, "config.json")):
        e.append(f"model.hf_path={m.hf_path!r}: no config.json there")

    # --- parallel sizes ------------------------------------------------------------------------
    _divides(e, "actor.tp", a.tp, "model.num_attention_heads", m.num_attention_heads)
    _divides(e, "actor.tp", a.tp, "model.num_query_groups", m.num_query_groups)
    _divides(e, "actor.tp", a.tp, "model.ffn_hidden_size", m.ffn_hidden_size)
    _divides(e, "actor.pp", a.pp, "model.num_layers", m.num_layers)
    if a.cp < 1:
        e.append(f"actor.cp={a.cp} must be positive")
    _choice(e, "actor.cp_comm_type", a.cp_comm_type, CP_COMM_TYPES)
    _choice(e, "actor.recompute", a.recompute, (None, "full", "selective"))
    if a.cp > 1 and a.cp_comm_type in ("a2a", "a2a+p2p") and (m.num_attention_heads // max(a.tp, 1)) % a.cp:
        e.append(f"actor.cp_comm_type={a.cp_comm_type!r} splits each rank's attention heads over CP ranks: "
                 f"model.num_attention_heads/actor.tp={m.num_attention_heads // max(a.tp, 1)} is not divisible by "
                 f"actor.cp={a.cp} (use actor.cp_comm_type=p2p)")
    if a.cp > 1 and al.policy_loss in POLICY_LOSSES and not POLICY_LOSSES[al.policy_loss].token_level:
        e.append(f"actor.cp={a.cp} splits every response over CP ranks, but algorithm.policy_loss="
                 f"{al.policy_loss!r} is sequence-level and needs each whole response on one rank "
                 "(use actor.cp=1 or a token-level loss such as vanilla)")
    _choice(e, "actor.fp8", a.fp8, (None, *FP8_FORMATS))
    _choice(e, "actor.fp8_recipe", a.fp8_recipe, FP8_RECIPES)
    if a.fp8 is not None and t.device == "cpu":
        e.append(f"actor.fp8={a.fp8!r} needs Transformer Engine on a GPU; on trainer.device=cpu use actor.fp8=null")
    if a.use_distributed_optimizer and t.device == "cpu":
        e.append("actor.use_distributed_optimizer=True needs CUDA tensors in megatron-core; "
                 "on trainer.device=cpu use actor.use_distributed_optimizer=false")
    _choice(e, "actor.logprob_impl", a.logprob_impl, LOGPROB_IMPLS)
    _choice(e, "actor.dtype", a.dtype, DTYPES)
    if a.dtype == "bf16" and t.device == "cpu":
        e.append("actor.dtype=bf16 needs CUDA (megatron's mixed-precision optimizer); on trainer.device=cpu "
                 "use actor.dtype=fp32")
    _choice(e, "actor.lr_decay_style", a.lr_decay_style, LR_DECAY_STYLES)
    if a.lr <= 0:
        e.append(f"actor.lr={a.lr} must be positive")
    if a.ppo_epochs < 1:
        e.append(f"actor.ppo_epochs={a.ppo_epochs} must be at least 1")
    if a.max_tokens_per_gpu < d.max_prompt_length + d.max_response_length and a.max_tokens_per_gpu > 0:
        e.append(f"actor.max_tokens_per_gpu={a.max_tokens_per_gpu} is smaller than one sequence "
                 f"(data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length})")
    if a.ppo_mini_batch_size is not None:
        _divides(e, "actor.ppo_mini_batch_size", a.ppo_mini_batch_size, "data.train_batch_size", d.train_batch_size)

    # --- resources -------------------------------------------------------------------------------
    _choice(e, "trainer.device", t.device, DEVICES)
    _choice(e, "rollout.engine", r.engine, ROLLOUT_ENGINES)
    _choice(e, "rollout.mode", r.mode, ROLLOUT_MODES)
    if t.nnodes < 1:
        e.append(f"trainer.nnodes={t.nnodes} must be at least 1")
    if t.n_gpus_per_node is not None and t.n_gpus_per_node < 1:
        e.append(f"trainer.n_gpus_per_node={t.n_gpus_per_node} must be at least 1")
    if r.num_engines < 1 or r.tp < 1:
        e.append(f"rollout.num_engines={r.num_engines} and rollout.tp={r.tp} must be at least 1")
    if r.engine == "sglang" and r.mode == "disaggregated" and a.pp > 1:
        e.append("rollout.mode=disaggregated with actor.pp>1: the per-stage NCCL weight broadcasts are not "
                 "serialised yet; use actor.pp=1 or rollout.mode=colocated")
    if r.health_check_interval_s <= 0 or r.health_check_timeout_s <= 0:
        e.append(f"rollout.health_check_interval_s={r.health_check_interval_s} and rollout.health_check_timeout_s="
                 f"{r.health_check_timeout_s} must be positive")
    if r.async_mode not in ("off", "one_step_off", "bounded_staleness"):
        e.append(f"rollout.async_mode={r.async_mode!r} is not one of ['off', 'one_step_off', 'bounded_staleness']")
    elif r.async_mode != "off":
        if r.shares_trainer_devices:
            e.append(f"rollout.async_mode={r.async_mode!r} overlaps generation with training, which rollout.mode="
                     f"{r.mode} engines cannot (they release their accelerators while the trainer runs); use "
                     "rollout.mode=disaggregated")
        if r.max_staleness < 1:
            e.append(f"rollout.max_staleness={r.max_staleness} must be at least 1 with rollout.async_mode="
                     f"{r.async_mode!r}")
    if t.max_ckpt_to_keep is not None and t.max_ckpt_to_keep < 1:
        e.append(f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep} must be at least 1 (or null to keep all)")
    lay = None
    if not e:
        lay = layout(cfg)
        mp = a.tp * a.pp * a.cp
        if lay.trainer_world < 1:
            e.append(f"rollout.num_engines*rollout.tp={lay.rollout_devices} leaves no accelerator for the trainer "
                     f"out of trainer.nnodes*trainer.n_gpus_per_node={lay.total}")
        elif lay.trainer_world % mp != 0:
            e.append(f"actor.tp*actor.pp*actor.cp={mp} does not divide the trainer's {lay.trainer_world} "
                     f"accelerators (trainer.nnodes*trainer.n_gpus_per_node"
                     f"{' - rollout.num_engines*rollout.tp' if r.mode == 'disaggregated' else ''})")
        if r.shares_trainer_devices and lay.rollout_devices > lay.total:
            e.append(f"rollout.num_engines*rollout.tp={lay.rollout_devices} exceeds the {lay.total} accelerators"
                     + (" (rollout.mode=hybrid: each engine lives in a trainer rank)" if r.mode == "hybrid" else ""))

    # --- data ------------------------------------------------------------------------------------
    for key in ("train_files", "val_files"):
        for i, f in enumerate(getattr(d, key)):
            if check_files and not os.path.exists(f):
                e.append(f"data.{key}[{i}]={f!r} does not exist")
            elif not f.endswith((".jsonl", ".json", ".parquet")):
                e.append(f"data.{key}[{i}]={f!r} is neither .jsonl nor .parquet")
    if not d.train_files:
        task = _registered(e, "data.synthetic_task", d.synthetic_task, SYNTHETIC_TASKS)
        if task is not None and task.data_source not in BUILTIN_REWARDS and task.data_source not in rw.custom_functions:
            e.append(f"data.synthetic_task={d.synthetic_task!r} makes records of data_source {task.data_source!r}, "
                     "which has no reward function; add one with reward.custom_functions")
    for name in ("max_prompt_length", "max_response_length", "train_batch_size"):
        if getattr(d, name) <= 0:
            e.append(f"data.{name}={getattr(d, name)} must be positive")
    if d.max_prompt_length + d.max_response_length > m.max_position_embeddings:
        e.append(f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length} "
                 f"exceeds model.max_position_embeddings={m.max_position_embeddings}")

    # --- algorithm -------------------------------------------------------------------------------
    estimator = _registered(e, "algorithm.adv_estimator", al.adv_estimator, ADVANTAGE_ESTIMATORS)
    _registered(e, "algorithm.policy_loss", al.policy_loss, POLICY_LOSSES)
    _registered(e, "algorithm.kl_loss_type", al.kl_loss_type, KL_ESTIMATORS)
    _registered(e, "algorithm.kl_penalty", al.kl_penalty, KL_ESTIMATORS)
    _registered(e, "algorithm.loss_agg_mode", al.loss_agg_mode, AGGREGATION_MODES)
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
    if estimator is not None and estimator.needs_groups and r.n < 2:
        e.append(f"rollout.n={r.n} must be at least 2 for algorithm.adv_estimator={al.adv_estimator!r} "
                 "(advantages are relative to the prompt group)")

    # --- rollout / evaluation / reward -----------------------------------------------------------
    if r.n < 1:
        e.append(f"rollout.n={r.n} must be at least 1")
    if r.temperature <= 0:
        e.append(f"rollout.temperature={r.temperature} must be positive for training rollouts "
                 "(use evaluation.temperature=0 for greedy validation)")
    if not 0 < r.top_p <= 1:
        e.append(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if ev.n < 1:
        e.append(f"evaluation.n={ev.n} must be at least 1")
    if ev.temperature < 0:
        e.append(f"evaluation.temperature={ev.temperature} must be non-negative")
    if rw.timeout_s <= 0:
        e.append(f"reward.timeout_s={rw.timeout_s} must be positive")
    for src, spec in rw.custom_functions.items():
        problem = spec_error(spec, src)
        if problem:
            e.append(problem)

    # --- trainer ---------------------------------------------------------------------------------
    if t.total_training_steps is not None and t.total_training_steps < 1:
        e.append(f"trainer.total_training_steps={t.total_training_steps} must be at least 1 (or null)")
    for name in t.logger:
        _choice(e, "trainer.logger[]", name, LOGGERS)
    if t.resume not in ("auto", "disable") and not os.path.isdir(t.resume):
        e.append(f"trainer.resume={t.resume!r} is neither 'auto', 'disable' nor a checkpoint directory")

    if e:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(e))
    assert lay is not None
    return lay


def resolve_device(cfg: MGRPOConfig) -> MGRPOConfig:
    """Resolve the 'auto' choices (a new config; the input is untouched): trainer.device becomes cuda
    when a GPU is visible, else cpu; actor.dtype becomes bf16 on cuda, fp32 on cpu; trainer.output_dir
    becomes absolute (Ray workers do not share the driver's working directory); asynchronous rollout
    turns on truncated importance sampling (algorithm.tis_cap=2.0) unless a cap is set."""
    device = cfg.trainer.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = cfg.actor.dtype if cfg.actor.dtype != "auto" else ("bf16" if device == "cuda" else "fp32")
    algorithm = cfg.algorithm
    if cfg.rollout.async_mode != "off" and algorithm.tis_cap is None:
        algorithm = replace(algorithm, tis_cap=2.0)
    return replace(cfg, trainer=replace(cfg.trainer, device=device, output_dir=os.path.abspath(output_dir(cfg))),
                   actor=replace(cfg.actor, dtype=dtype), algorithm=algorithm)


def output_dir(cfg: MGRPOConfig) -> str:
    t = cfg.trainer
    return t.output_dir or os.path.join("outputs", t.project_name, t.experiment_name)
