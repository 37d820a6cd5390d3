"""The veRL key table of mgrpo.compat.verl: what becomes of each veRL key.

Each rule takes the key's value and every value on the command line (some translations need two keys,
e.g. min_lr_ratio x lr) and returns [(mgrpo key, value), ...], or [("", reason)] for a key accepted and
ignored, or raises Refuse(reason). Exact keys first (RULES), then whole subtrees (PREFIX_RULES);
VALUE_RULES translate the values of keys both projects spell the same.
Layout keys (parallel sizes for the actor and the reference, offloading, Megatron engine settings) are in
layout.py, the multi-turn keys (actor_rollout_ref.rollout.multi_turn.*) in multi_turn.py. Sources: veRL's verl/trainer/config/_generated_ppo_{,megatron_}trainer.yaml, examples/ and the DAPO
recipe (verl-recipe dapo/).
"""

from __future__ import annotations

from typing import Optional

from mgrpo.compat.verl.kit import A, F, M, MICRO, PROFILE, R, TUNING, Refuse, Rule, falsy, ignore, only, refuse, to
from mgrpo.compat.verl.distill import DISTILL_RULES, enabled, task_rewards, teacher_rule
from mgrpo.compat.verl.layout import LAYOUT_PREFIX_RULES, LAYOUT_RULES
from mgrpo.compat.verl.lora import LORA_RULES
from mgrpo.compat.verl.multi_turn import MULTI_TURN_RULES
from mgrpo.compat.verl.reward import REWARD_PREFIX_RULES, REWARD_RULES
from mgrpo.models.hf_config import hf_architecture, resolve_hf_dir

VERL_ONLY_PREFIXES = ("actor_rollout_ref.", "critic.", "reward_model.", "reward_manager.", "custom_reward_function.",
                      "ray_kwargs.", "ray_init.", "global_profiler.", "transfer_queue.", "reward.reward_kwargs.",
                      "reward.reward_manager.", "reward.reward_model.", "reward.custom_reward_function.",
                      "reward.sandbox_fusion.", "sandbox_fusion.", "distillation.")
# veRL's trainer configs (verl/trainer/config/, and the DAPO recipe's): what --config-name=<name> is taken to mean.
VERL_CONFIG_NAMES = {
    "ppo_trainer": "veRL's FSDP trainer config",
    "ppo_megatron_trainer": "veRL's Megatron trainer config",
    "dapo_trainer": "veRL's DAPO recipe config (FSDP)",
    "dapo_megatron_trainer": "veRL's DAPO recipe config (Megatron)",
}
# Hydra flags that take the next argument as their value when written without '='.
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
               "--config-dir", "-cd", "--experimental-rerun")
INFO_CHOICES = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
KL_NAMES = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "k3": "k3", "low_var_kl": "low_var_kl"}
# veRL defaults that differ from mgrpo's, shown when a veRL command line leaves them unset.
DEFAULT_DIFFS = (
    (A + "clip_ratio_c", "3.0 (dual-clip on)", "algorithm.clip_ratio_c", "null (off)"),
    (A + "use_kl_loss", "false (no KL term in the loss)", "algorithm.use_kl_loss", "true"),
    (A + "entropy_coeff", "0", "algorithm.entropy_coeff", "0.01"),
    (A + "optim.weight_decay", "0.01", "actor.weight_decay", "0.0"),
    (A + "optim.betas", "[0.9, 0.999]", "actor.adam_beta1/adam_beta2", "0.9/0.99"),
    (A + "megatron.use_distributed_optimizer", "true", "actor.use_distributed_optimizer", "false"),
    ("trainer.val_before_train", "true", "trainer.val_before_train", "false"),
    ("trainer.total_epochs", "30 (trainer.total_training_steps null: epochs x batches)",
     "trainer.total_training_steps", "150"),
)


def _kl_name(v):
    if v not in KL_NAMES:
        raise Refuse(f"KL estimator {v!r} has no mgrpo equivalent (mgrpo has {sorted(set(KL_NAMES.values()))})")
    return KL_NAMES[v]


def _betas(v, ctx):
    if not (isinstance(v, list) and len(v) == 2):
        raise Refuse("expected [beta1, beta2]")
    return [("actor.adam_beta1", float(v[0])), ("actor.adam_beta2", float(v[1]))]


def _warmup_steps(v, ctx):
    return [] if v is None or v < 0 else [("actor.lr_warmup_steps", int(v))]  # -1: veRL's "use the ratio"


def _warmup_ratio(v, ctx):
    if not v:
        return [("", "0: no warm-up")]
    if (ctx.get(A + "optim.lr_warmup_steps") or -1) > 0:
        return [("", "unused: optim.lr_warmup_steps is set (veRL prefers it)")]
    total = ctx.get("trainer.total_training_steps")
    if total is None:
        raise Refuse("veRL multiplies it by the step count it derives from the dataset; give "
                      f"{A}optim.lr_warmup_steps (RL steps) instead, or trainer.total_training_steps on the same line")
    return [("actor.lr_warmup_steps", int(v * total))]


def _min_lr_ratio(v, ctx):
    lr = ctx.get(A + "optim.lr")
    if lr is None:
        raise Refuse(f"mgrpo takes an absolute actor.min_lr: give {A}optim.lr on the same line")
    return [("actor.min_lr", float(v) * float(lr))]


def _scheduler_type(v, ctx):
    if v not in ("constant", "cosine", "linear"):
        raise Refuse(f"lr schedule {v!r}: mgrpo has constant | linear | cosine")
    return [("actor.lr_decay_style", v)]


def _kl_coef_in_reward(v, ctx):
    if not ctx.get("algorithm.use_kl_in_reward", False):
        return [("", "unused: algorithm.use_kl_in_reward is false")]
    loss_coef = ctx.get(A + "kl_loss_coef", 0.001)
    if ctx.get(A + "use_kl_loss", False) and float(loss_coef) != float(v):
        raise Refuse(f"mgrpo has one algorithm.kl_coef for the KL loss and the KL in reward; this line asks "
                      f"for {loss_coef} and {v}")
    return [("algorithm.kl_coef", float(v))]


def _recompute(v, ctx):
    return [("actor.recompute", "full")] if v else [("", "off, as in mgrpo")]


def _model_path(v, ctx):
    hf_dir = resolve_hf_dir(str(v))
    if hf_dir is None and str(v).startswith(("/", ".", "~")):
        raise Refuse(f"{v!r} has no config.json (a Hugging Face checkpoint directory is needed)")
    if hf_dir is None:
        raise Refuse(f"{v!r} is neither a directory with config.json nor in the local Hugging Face cache; mgrpo "
                      f"does not download: `huggingface-cli download {v} --local-dir DIR`, then {M}path=DIR")
    try:
        arch = hf_architecture(hf_dir)
    except (ValueError, KeyError, OSError) as e:
        raise Refuse(str(e)) from None
    return [("model.hf_path", hf_dir)] + [(f"model.{k}", x) for k, x in arch.items()]


def _rollout_name(v, ctx):
    if v in ("sglang", "hf"):
        return [("rollout.engine", v)]
    raise Refuse(f"rollout engine {v!r}: mgrpo generates with SGLang (GPU) or its in-process hf engine (CPU); "
                  f"use {R}name=sglang")


def _logger(v, ctx):
    names = v if isinstance(v, list) else [v]
    keep = [n for n in names if n in ("console", "tensorboard")]
    dropped = [n for n in names if n not in keep]
    out = [("trainer.logger", keep or ["console"])]
    if dropped:
        out.append(("", f"dropped {dropped}: mgrpo logs to the console, TensorBoard and metrics.jsonl"))
    return out


def _resume_mode(v, ctx):
    if v in ("auto", "disable"):
        return [("trainer.resume", v)]
    if v == "resume_path" and ctx.get("trainer.resume_from_path"):
        return [("trainer.resume", ctx["trainer.resume_from_path"])]
    raise Refuse(f"resume_mode {v!r}: mgrpo has auto | disable | a checkpoint directory")


def _max_resp_len(v, ctx):
    limit = ctx.get("data.max_response_length")
    if limit is not None and int(v) == int(limit):
        return [("", "= data.max_response_length, where mgrpo's overlong buffer ends")]
    where = "not on this line" if limit is None else limit
    raise Refuse(f"mgrpo's overlong buffer ends at data.max_response_length ({where}); DAPO's max_resp_len must "
                 "equal it")


def _total_epochs(v, ctx):
    """veRL derives the step count from epochs x batches unless total_training_steps is given: mgrpo's own
    default step count must not win over the line's epochs."""
    out = [("trainer.total_epochs", int(v))]
    if "trainer.total_training_steps" not in ctx:
        out.append(("trainer.total_training_steps", None))
    return out


def _max_ckpt(v, ctx):
    return [("", "null: keep all, as in mgrpo")] if v is None else [("trainer.max_ckpt_to_keep", int(v))]


def _adv_estimator(v, ctx):
    if v == "gae":
        raise Refuse("gae needs a critic; mgrpo trains critic-free estimators (grpo, dr_grpo, rloo, "
                      "reinforce_plus_plus[_baseline])")
    if enabled(ctx) and not task_rewards(ctx):
        return [("", "superseded: distillation.distillation_loss.use_task_rewards=false trains on the teacher alone "
                     "(algorithm.adv_estimator=none)")]
    return [("algorithm.adv_estimator", v)]


def _val(key: str) -> Rule:
    return to(f"evaluation.{key}")


def _val_do_sample(v, ctx):
    return [] if v else [("evaluation.temperature", 0.0)]


RULES: dict[str, Rule] = {
    # optimizer and schedule
    A + "optim.lr": to("actor.lr", float),
    A + "optim.weight_decay": to("actor.weight_decay", float),
    A + "optim.clip_grad": to("actor.grad_clip", float),
    A + "grad_clip": to("actor.grad_clip", float),
    A + "optim.betas": _betas,
    A + "optim.min_lr": to("actor.min_lr", float),
    A + "optim.min_lr_ratio": _min_lr_ratio,
    A + "optim.lr_decay_style": _scheduler_type,
    A + "optim.lr_scheduler_type": _scheduler_type,
    A + "optim.warmup_style": _scheduler_type,
    A + "optim.lr_warmup_steps": _warmup_steps,
    A + "optim.lr_warmup_steps_ratio": _warmup_ratio,
    A + "optim.lr_warmup_init": only(falsy, "0: mgrpo warms up from 0", "mgrpo warms up from lr 0"),
    A + "optim.lr_decay_steps": only(lambda v: v is None, "null: decay over the whole run, as in mgrpo",
                                     "mgrpo decays over trainer.total_training_steps"),
    A + "optim.total_training_steps": only(lambda v: v in (None, -1), "veRL fills it in at run time",
                                           "set trainer.total_training_steps instead"),
    A + "optim.optimizer": only(lambda v: str(v).lower() in ("adam", "adamw"),
                                "megatron's Adam (decoupled weight decay, i.e. AdamW)", "mgrpo trains with Adam(W) only"),
    A + "optim.num_cycles": only(lambda v: v == 0.5, "half a cosine, as megatron's", "mgrpo's cosine is half a cycle"),
    A + "optim.weight_decay_incr_style": only(lambda v: v == "constant", "constant, as in mgrpo",
                                              "mgrpo keeps weight decay constant"),
    A + "optim.use_checkpoint_opt_param_scheduler": ignore("mgrpo restores the LR schedule with the checkpoint"),
    A + "optim.override_optimizer_config": only(falsy, "empty", "not passed through to megatron's optimizer"),
    # batches and loss
    A + "ppo_mini_batch_size": to("actor.ppo_mini_batch_size", int),
    A + "ppo_epochs": to("actor.ppo_epochs", int),
    A + "ppo_micro_batch_size": ignore(MICRO),
    A + "ppo_micro_batch_size_per_gpu": ignore(MICRO),
    A + "use_dynamic_bsz": ignore(MICRO),
    A + "ppo_max_token_len_per_gpu": to("actor.max_tokens_per_gpu", int),
    A + "shuffle": ignore("mgrpo shuffles prompt groups into mini-batches with a seeded generator"),
    A + "data_loader_seed": ignore("mgrpo seeds mini-batch shuffling from trainer.seed"),
    A + "use_kl_loss": to("algorithm.use_kl_loss", bool),
    A + "kl_loss_coef": to("algorithm.kl_coef", float),
    A + "kl_loss_type": to("algorithm.kl_loss_type", _kl_name),
    A + "entropy_coeff": to("algorithm.entropy_coeff", float),
    A + "calculate_entropy": ignore("mgrpo always computes the entropy metric"),
    A + "clip_ratio": lambda v, ctx: [(f"algorithm.clip_ratio_{s}", float(v)) for s in ("low", "high")
                                      if ctx.get(A + f"clip_ratio_{s}") is None],
    A + "clip_ratio_low": to("algorithm.clip_ratio_low", float),
    A + "clip_ratio_high": to("algorithm.clip_ratio_high", float),
    A + "clip_ratio_c": to("algorithm.clip_ratio_c", float),
    A + "loss_agg_mode": to("algorithm.loss_agg_mode"),
    A + "policy_loss.loss_mode": to("algorithm.policy_loss"),
    A + "loss_scale_factor": only(lambda v: v is None, "null", "not supported (seq-mean-token-sum-norm uses "
                                  "data.max_response_length)"),
    A + "use_torch_compile": ignore("speed only"),
    A + "use_fused_kernels": ignore("mgrpo's log-prob path never materialises full logits (actor.logprob_impl)"),
    A + "strategy": ignore("mgrpo trains with Megatron whatever the strategy"),
    A + "entropy_from_logits_with_chunking": ignore("mgrpo's log-prob path is always chunked"),
    A + "entropy_checkpointing": ignore("memory only"),
    # reference model (its layout keys: layout.py)
    F + "log_prob_micro_batch_size": ignore(MICRO),
    F + "log_prob_micro_batch_size_per_gpu": ignore(MICRO),
    F + "log_prob_use_dynamic_bsz": ignore(MICRO),
    F + "log_prob_max_token_len_per_gpu": ignore(MICRO),
    F + "strategy": ignore("mgrpo's reference is a frozen Megatron copy of the actor"),
    F + "use_torch_compile": ignore("speed only"),
    # model
    M + "path": _model_path,
    M + "tokenizer_path": lambda v, ctx: [] if v is None else [("model.tokenizer", str(v))],
    M + "enable_gradient_checkpointing": _recompute,
    M + "use_remove_padding": ignore("mgrpo packs sequences itself"),
    M + "use_fused_kernels": ignore("mgrpo's log-prob path never materialises full logits (actor.logprob_impl)"),
    M + "use_liger": ignore("mgrpo's log-prob path never materialises full logits (actor.logprob_impl)"),
    M + "use_shm": ignore("load speed only"),
    M + "trust_remote_code": ignore("mgrpo reads config.json itself"),
    M + "external_lib": only(falsy, "null", "mgrpo trains dense Qwen3 only"),
    M + "enable_activation_offload": only(falsy, "false, as in mgrpo",
                                            "mgrpo does not offload activations; actor.recompute=full (veRL's "
                                            "enable_gradient_checkpointing) keeps one layer's at a time"),
    M + "custom_chat_template": only(falsy, "null", "mgrpo applies the tokenizer's own chat template"),
    # rollout
    R + "name": _rollout_name,
    R + "n": to("rollout.n", int),
    R + "temperature": to("rollout.temperature", float),
    R + "top_p": to("rollout.top_p", float),
    R + "top_k": to("rollout.top_k", int),
    R + "tensor_model_parallel_size": to("rollout.tp", int),
    R + "gpu_memory_utilization": to("rollout.gpu_memory_utilization", float),
    R + "update_weights_bucket_megabytes": to("rollout.update_weights_bucket_mb", int),
    R + "checkpoint_engine.update_weights_bucket_megabytes": to("rollout.update_weights_bucket_mb", int),
    R + "do_sample": only(lambda v: v is True, "true: training rollouts sample", "training rollouts must sample"),
    R + "ignore_eos": only(falsy, "false, as in mgrpo", "mgrpo stops at EOS"),
    R + "over_sample_rate": to("rollout.over_sample_rate", float),
    R + "calculate_log_probs": ignore("mgrpo always keeps the rollout log-probs"),
    R + "dtype": only(lambda v: v in ("bfloat16", "bf16"), "bf16, as mgrpo's SGLang", "mgrpo's SGLang serves bf16"),
    R + "mode": ignore("mgrpo's engines are servers driven asynchronously"),
    **MULTI_TURN_RULES,
    **LORA_RULES,
    R + "val_kwargs.temperature": _val("temperature"),
    R + "val_kwargs.top_p": _val("top_p"),
    R + "val_kwargs.n": _val("n"),
    R + "val_kwargs.do_sample": _val_do_sample,
    R + "val_kwargs.top_k": only(lambda v: v in (-1, 0, None), "no top-k", "mgrpo's evaluation has no top_k"),
    R + "data_parallel_size": only(lambda v: v == 1, "1", "set rollout.num_engines instead"),
    R + "pipeline_model_parallel_size": only(lambda v: v == 1, "1", "mgrpo's engines use tensor parallelism only"),
    R + "expert_parallel_size": to("rollout.ep", int),
    R + "free_cache_engine": ignore("colocated engines release their memory while the trainer trains"),
    R + "prompt_length": ignore("follows data.max_prompt_length"),
    R + "response_length": ignore("follows data.max_response_length"),
    **{R + k: ignore(TUNING) for k in ("enforce_eager", "cudagraph_capture_sizes", "enable_chunked_prefill",
                                       "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs",
                                       "max_model_len", "disable_log_stats", "load_format", "scheduling_policy",
                                       "skip_tokenizer_init", "layered_summon")},
    **{R + k: ignore(MICRO) for k in ("log_prob_micro_batch_size", "log_prob_micro_batch_size_per_gpu",
                                      "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu")},
    "actor_rollout_ref.hybrid_engine": only(lambda v: v is True, "true: colocated, as rollout.mode=colocated",
                                            "use rollout.mode=disaggregated"),
    "actor_rollout_ref.nccl_timeout": ignore("communication timeout only"),
    # data (keys that only veRL has; shared ones pass through)
    "data.filter_overlong_prompts": ignore("mgrpo always drops (and counts) prompts over data.max_prompt_length"),
    "data.truncation": only(lambda v: v == "error", "prompts over the limit are dropped and counted instead",
                            "mgrpo drops over-long prompts instead of truncating them"),
    "data.reward_fn_key": only(lambda v: v == "data_source", "data_source, as in mgrpo",
                               "mgrpo picks the reward function by data_source"),
    "data.tokenizer": lambda v, ctx: [] if v is None else [("model.tokenizer", str(v))],
    "data.val_max_samples": lambda v, ctx: [] if v in (None, -1) else [("evaluation.max_prompts", int(v))],
    "data.train_max_samples": only(lambda v: v in (None, -1), "-1: all", "not supported: trim the data file"),
    "data.custom_cls.path": only(falsy, "null", "mgrpo reads RL records (JSONL/Parquet) itself"),
    "data.apply_chat_template_kwargs.enable_thinking": to("data.enable_thinking", bool),
    **{f"data.{k}": ignore("data loading only") for k in ("filter_overlong_prompts_workers", "dataloader_num_workers",
                                                          "use_shm", "return_raw_chat", "return_raw_input_ids",
                                                          "return_full_prompt", "validation_shuffle",
                                                          "trust_remote_code", "val_batch_size", "image_key",
                                                          "video_key", "return_multi_modal_inputs")},
    # algorithm
    "algorithm.kl_ctrl.kl_coef": _kl_coef_in_reward,
    "algorithm.kl_ctrl.type": only(lambda v: v == "fixed", "fixed, as mgrpo's", "mgrpo's KL coefficient is fixed"),
    "algorithm.kl_ctrl.horizon": ignore("adaptive KL only"),
    "algorithm.kl_ctrl.target_kl": ignore("adaptive KL only"),
    "algorithm.gamma": only(lambda v: v == 1.0, "1.0, as in mgrpo", "mgrpo's returns are undiscounted"),
    "algorithm.lam": only(lambda v: v == 1.0, "1.0 (GAE only)", "mgrpo has no GAE"),
    "algorithm.use_pf_ppo": only(falsy, "false", "mgrpo has no PF-PPO"),
    "algorithm.filter_groups.metric": only(lambda v: v in ("acc", "score", "seq_reward", "seq_final_reward"),
                                           "mgrpo keeps groups whose rewards differ",
                                           "mgrpo filters on the reward"),
    "algorithm.rollout_correction.rollout_is": only(falsy, "null", "use algorithm.tis_cap (truncated IS weight)"),
    "algorithm.rollout_correction.rollout_rs": only(falsy, "null", "mgrpo has no rejection sampling correction"),
    # trainer
    "trainer.resume_mode": _resume_mode,
    "trainer.resume_from_path": ignore("used with trainer.resume_mode=resume_path"),
    "trainer.default_local_dir": to("trainer.output_dir", str),
    "trainer.max_actor_ckpt_to_keep": _max_ckpt,
    "trainer.max_critic_ckpt_to_keep": ignore("no critic"),
    "trainer.critic_warmup": only(falsy, "0 (no critic)", "mgrpo has no critic"),
    "trainer.balance_batch": ignore("mgrpo always balances data-parallel shards by tokens"),
    "trainer.log_val_generations": ignore("mgrpo writes trajectories.jsonl"),
    "trainer.rollout_data_dir": ignore("mgrpo writes trajectories.jsonl in the run directory"),
    "trainer.device": only(lambda v: v in ("cuda", "cpu"), "", "mgrpo runs on cuda or cpu"),
    **{f"trainer.{k}": ignore("operations only") for k in ("del_local_ckpt_after_load", "esi_redundant_time",
                                                            "ray_wait_register_center_timeout", "default_hdfs_dir",
                                                            "use_legacy_worker_impl")},
    # DAPO's overlong reward shaping: the recipe's old keys, veRL's reward_kwargs (examples/) and the recipe's
    # newer reward.reward_kwargs (dapo_trainer.yaml)
    **{f"{prefix}{k}": rule
       for prefix in ("reward_model.overlong_buffer.", "reward_model.reward_kwargs.overlong_buffer_cfg.",
                      "reward.reward_kwargs.overlong_buffer_cfg.")
       for k, rule in (("enable", to("algorithm.overlong_buffer.enable", bool)),
                       ("len", to("algorithm.overlong_buffer.len", int)),
                       ("penalty_factor", to("algorithm.overlong_buffer.penalty_factor", float)),
                       ("log", ignore("logging only: mgrpo counts reward/overlong_penalised")))},
    "reward_model.reward_kwargs.max_resp_len": _max_resp_len,
    "reward.reward_kwargs.max_resp_len": _max_resp_len,
    "data.gen_batch_size": only(lambda v: v is None, "null", "mgrpo generates data.train_batch_size prompts per round "
                                "(dynamic sampling adds rounds until the batch is full); drop the key"),
    **REWARD_RULES,
    **LAYOUT_RULES,
    **DISTILL_RULES,
}
# Whole subtrees with one outcome (longest prefix wins after the exact keys above).
PREFIX_RULES: dict[str, Rule] = {
    **LAYOUT_PREFIX_RULES, "critic.": ignore("GRPO-family: no critic"),
    **REWARD_PREFIX_RULES,
    M + "override_config.": refuse("mgrpo reads the architecture from config.json: change it there"),
    A + "profiler.": ignore(PROFILE), F + "profiler.": ignore(PROFILE), R + "profiler.": ignore(PROFILE),
    "global_profiler.": ignore(PROFILE), A + "checkpoint.": ignore("mgrpo checkpoints model, optimizer and state"),
    "ray_init.": ignore("mgrpo starts Ray itself (trainer.ray_address to join one)"),
    "ray_kwargs.": ignore("mgrpo starts Ray itself (trainer.ray_address to join one)"),
    R + "engine_kwargs.": refuse("engine arguments are not passed through to SGLang"),
    R + "agent.": ignore("agent-loop workers and servers: mgrpo runs every trajectory as its own coroutine "
                         "(rollout.multi_turn.max_concurrent_per_engine)"),
    R + "multi_turn.": refuse("this multi-turn setting has no mgrpo equivalent (see rollout.multi_turn.*)"),
    R + "trace.": ignore(PROFILE), R + "prometheus.": ignore(PROFILE),
    "distillation.": refuse("this distillation setting has no mgrpo equivalent (see docs/distillation.md)"),
}
# Shared keys whose veRL values need a translation too.
VALUE_RULES: dict[str, Rule] = {
    "data.train_files": lambda v, ctx: [("data.train_files", v if isinstance(v, list) else [v])],
    "data.val_files": lambda v, ctx: [("data.val_files", v if isinstance(v, list) else [v])],
    "algorithm.kl_penalty": to("algorithm.kl_penalty", _kl_name),
    "algorithm.adv_estimator": _adv_estimator,
    "trainer.logger": _logger,
    "data.seed": lambda v, ctx: [] if v is None else [("data.seed", int(v))],
    "trainer.total_epochs": _total_epochs,
}


def rule_for(key: str) -> Optional[Rule]:
    if key in RULES:
        return RULES[key]
    teacher = teacher_rule(key)  # distillation.teacher_models.<name>.*: the name is the user's
    if teacher is not None:
        return teacher
    for prefix in sorted(PREFIX_RULES, key=len, reverse=True):
        if key.startswith(prefix):
            return PREFIX_RULES[prefix]
    return None
