"""slime command lines: `mgrpo-train` takes slime's train.py flags and translates them into mgrpo's keys.

    mgrpo-train --hf-checkpoint /models/Qwen3-8B --prompt-data train.jsonl --rollout-batch-size 16 \\
        --n-samples-per-prompt 4 --advantage-estimator grpo --lr 1e-6 \\
        --use-opd --opd-type megatron --opd-kl-coef 1.0 --opd-teacher-load /models/Qwen3-32B

slime's flags are argparse's (`--name value`, `--name=value`, `--switch`); any `--name` that is not one of
Hydra's own flags is read as slime's. Each gets exactly one outcome, printed as a table: translated to mgrpo keys,
accepted and ignored with the reason (speed and memory knobs, Megatron settings mgrpo takes from the checkpoint),
or refused by name with the reason (SlimeFlagError, exit status 2). Flags not in the table are refused. mgrpo's
own `key=value` overrides may follow on the same line. The translated line then goes on to the veRL layer and
Hydra, so whatever it sets is checked like any other override (a Megatron architecture flag that disagrees with
--hf-checkpoint's config.json fails there, naming both).

Units follow slime: --rollout-batch-size counts prompts, --global-batch-size counts samples (one optimizer step),
--num-rollout counts RL steps. slime's SGLang teacher is a server the user starts (--opd-teacher-url, --rm-url);
mgrpo starts its SGLang teacher itself from teacher.hf_path, so a line with --opd-type sglang names that folder.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Sequence

from mgrpo.compat.verl.kit import Refuse, hydra_value, ignore, only, refuse, to
from mgrpo.compat.verl.rules import INFO_CHOICES, KL_NAMES, VALUE_FLAGS, _model_path
from mgrpo.compat.verl.translate import Translation
from mgrpo.config.validate import ConfigError, resolved_device

HYDRA_FLAGS = frozenset({*VALUE_FLAGS, "--help", "-h", "--hydra-help", "--version", "--resolve", "--run", "-r",
                         "--multirun", "-m", "--shell-completion", "-sc", "--info", "-i"})

SPEED = "speed/memory only (the result is the same)"
MEGATRON = "Megatron setting mgrpo chooses itself (from the checkpoint and its own defaults)"
ARCH = "Qwen3's architecture: mgrpo reads it from --hf-checkpoint's config.json"
MICRO = "mgrpo packs micro-batches by tokens (actor.max_tokens_per_gpu); the loss is normalised over the mini-batch"
LOGGER = "a logger mgrpo does not have (TensorBoard and metrics.jsonl are written to trainer.output_dir)"
EXTERNAL = ("a teacher or reward server you started; mgrpo starts the SGLang teacher itself: --use-opd --opd-type "
            "sglang teacher.hf_path=<the teacher's HF folder>")


class SlimeFlagError(ConfigError):
    """slime flags mgrpo cannot honour; the message names each with its reason."""


def _number(v: str):
    try:
        return int(v)
    except ValueError:
        return float(v)


def _estimator(v, ctx):
    if v in ("grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        return [("algorithm.adv_estimator", v)]
    if v == "gspo":  # slime names the sequence-level ratio an estimator; mgrpo's is the policy loss
        return [("algorithm.adv_estimator", "grpo"), ("algorithm.policy_loss", "gspo")]
    if v == "on_policy_distillation":  # slime's first OPD form: the teacher's signal alone
        if "--use-opd" not in ctx:
            raise Refuse("slime's first OPD form; mgrpo's teacher comes from --use-opd --opd-type ... (add them)")
        return [("algorithm.adv_estimator", "none")]
    raise Refuse(f"{v!r}: mgrpo has grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline (no critic: "
                 "ppo is not there)")


def _opd(v, ctx):
    if not ctx.get("--opd-type"):
        raise Refuse("--opd-type megatron|sglang is required with --use-opd (as slime requires it)")
    return [("", "on: the teacher comes from --opd-type and its flags")]


def _opd_flag(rule):
    """An --opd-* flag: only with --use-opd (slime ignores it otherwise; a line that sets it meant distillation)."""
    def checked(v, ctx):
        if "--use-opd" not in ctx:
            raise Refuse("set without --use-opd: add --use-opd, or remove it")
        return rule(v, ctx)
    return checked


def _opd_type(v, ctx):
    if v == "megatron":
        if not ctx.get("--opd-teacher-load"):
            raise Refuse("--opd-type megatron needs --opd-teacher-load (as slime requires it)")
        return [("teacher.mode", "megatron")]
    if v == "sglang":
        if ctx.get("--opd-teacher-load"):
            raise Refuse("--opd-teacher-load must not be set with --opd-type sglang (as slime refuses it)")
        if "teacher.hf_path" not in ctx:
            raise Refuse("mgrpo starts the SGLang teacher itself: add teacher.hf_path=<the teacher's HF folder> "
                         "(slime reaches a server you started, at --opd-teacher-url / --rm-url)")
        return [("teacher.mode", "sglang")]
    raise Refuse(f"{v!r}: megatron or sglang")


def _teacher_load(v, ctx):
    if not os.path.isfile(os.path.join(os.path.expanduser(v), "config.json")):
        raise Refuse(f"{v!r} has no config.json: mgrpo loads a teacher from a Hugging Face folder (export a "
                     "Megatron checkpoint with Megatron-Bridge or slime's convert_torch_dist_to_hf.py)")
    return [("teacher.hf_path", os.path.expanduser(v))]


def _global_batch(v, ctx):
    n = int(ctx.get("--n-samples-per-prompt", 1))
    if int(v) % n:
        raise Refuse(f"{v} samples per optimizer step is not a whole number of groups of --n-samples-per-prompt {n}")
    return [("actor.ppo_mini_batch_size", int(v) // n)]  # mgrpo's mini-batch counts prompts, as veRL's


def _steps_per_rollout(v, ctx):
    if "--global-batch-size" in ctx:
        return [("", "implied by --global-batch-size")]
    prompts = int(ctx.get("--rollout-batch-size", 32))
    if prompts % int(v):
        raise Refuse(f"--rollout-batch-size {prompts} does not split into {v} optimizer steps")
    return [("actor.ppo_mini_batch_size", prompts // int(v))]


def _clip(side):
    def rule(v, ctx):
        out = [(f"algorithm.clip_ratio_{side}", float(v))]
        if side == "low" and "--eps-clip-high" not in ctx:
            out.append(("algorithm.clip_ratio_high", float(v)))  # slime: eps_clip_high defaults to eps_clip
        return out
    return rule


def _kl_type(v, ctx):
    if v not in KL_NAMES:
        raise Refuse(f"{v!r}: mgrpo has {', '.join(sorted(KL_NAMES))}")
    return [("algorithm.kl_loss_type", KL_NAMES[v])]


def _custom_rm(v, ctx):
    raise Refuse("slime's reward functions take (args, sample); mgrpo calls veRL's compute_score(data_source, "
                 "solution_str, ground_truth, extra_info): set custom_reward_function.path=FILE "
                 "custom_reward_function.name=FUNCTION")


def _placement(v, ctx):
    """--actor-num-nodes, --actor-num-gpus-per-node, --rollout-num-gpus, --colocate: mgrpo's node count, the GPUs
    of a node, and where the engines go (one row, from all four)."""
    return [("", "in the placement row below")]


def placement(ctx: dict) -> list[tuple[str, object]]:
    nodes, per_node = int(ctx.get("--actor-num-nodes", 1)), int(ctx.get("--actor-num-gpus-per-node", 8))
    engine_tp = int(ctx.get("--rollout-num-gpus-per-engine", 1))
    if "--colocate" in ctx:
        return [("trainer.nnodes", nodes), ("trainer.n_gpus_per_node", per_node), ("rollout.mode", "colocated")]
    rollout = int(ctx.get("--rollout-num-gpus", per_node * nodes))
    if rollout % nodes or rollout % engine_tp:
        raise Refuse(f"--rollout-num-gpus {rollout} over --actor-num-nodes {nodes}: mgrpo's nodes are alike, so the "
                     f"engines' GPUs must split evenly over them and into engines of {engine_tp}")
    return [("trainer.nnodes", nodes), ("trainer.n_gpus_per_node", per_node + rollout // nodes),
            ("rollout.mode", "disaggregated"), ("rollout.num_engines", rollout // engine_tp)]


FLAGS: dict[str, tuple[bool, object]] = {
    # name: (takes a value, rule)
    "--hf-checkpoint": (True, _model_path),
    "--ref-load": (True, ignore("the reference is the actor's starting weights (--hf-checkpoint)")),
    "--load": (True, ignore("mgrpo resumes from trainer.output_dir's latest checkpoint (trainer.resume=auto)")),
    "--save": (True, to("trainer.output_dir")),
    "--save-interval": (True, to("trainer.save_freq", int)),
    "--seed": (True, to("trainer.seed", int)),
    "--prompt-data": (True, lambda v, ctx: [("data.train_files", [v])]),
    "--input-key": (True, to("data.prompt_key")),
    "--apply-chat-template": (False, lambda v, ctx: [("data.apply_chat_template", True)]),
    "--rollout-shuffle": (False, lambda v, ctx: [("data.shuffle", True)]),
    "--num-rollout": (True, to("trainer.total_training_steps", int)),
    "--num-epoch": (True, to("trainer.total_epochs", int)),
    "--rollout-batch-size": (True, to("data.train_batch_size", int)),
    "--n-samples-per-prompt": (True, to("rollout.n", int)),
    "--rollout-max-response-len": (True, to("data.max_response_length", int)),
    "--rollout-max-prompt-len": (True, to("data.max_prompt_length", int)),
    "--rollout-temperature": (True, to("rollout.temperature", float)),
    "--rollout-top-p": (True, to("rollout.top_p", float)),
    "--rollout-top-k": (True, to("rollout.top_k", int)),
    "--global-batch-size": (True, _global_batch),
    "--num-steps-per-rollout": (True, _steps_per_rollout),
    "--balance-data": (False, ignore(MICRO)),
    "--use-dynamic-batch-size": (False, ignore(MICRO)),
    "--micro-batch-size": (True, ignore(MICRO)),
    "--max-tokens-per-gpu": (True, to("actor.max_tokens_per_gpu", int)),
    "--tensor-model-parallel-size": (True, to("actor.tp", int)),
    "--pipeline-model-parallel-size": (True, to("actor.pp", int)),
    "--context-parallel-size": (True, to("actor.cp", int)),
    "--expert-model-parallel-size": (True, to("actor.ep", int)),
    "--expert-tensor-parallel-size": (True, only(lambda v: int(v) == 1, "mgrpo's experts are never split by TP",
                                                 "mgrpo never splits experts by TP (expert TP 1)")),
    "--sequence-parallel": (False, ignore("mgrpo turns sequence parallelism on with TP > 1")),
    "--recompute-granularity": (True, lambda v, ctx: [("actor.recompute", v)]),
    "--recompute-method": (True, ignore("mgrpo recomputes every layer (full) or attention (selective)")),
    "--recompute-num-layers": (True, ignore("mgrpo recomputes every layer (full) or attention (selective)")),
    "--advantage-estimator": (True, _estimator),
    "--disable-grpo-std-normalization": (False, lambda v, ctx: [("algorithm.norm_adv_by_std_in_grpo", False)]),
    "--use-kl-loss": (False, lambda v, ctx: [("algorithm.use_kl_loss", True)]),
    "--kl-loss-coef": (True, to("algorithm.kl_coef", float)),
    "--kl-loss-type": (True, _kl_type),
    "--kl-coef": (True, only(lambda v: float(v) == 0, "no KL in the reward (slime's default)",
                             "mgrpo's KL in the reward shares algorithm.kl_coef with the KL loss; set "
                             "algorithm.use_kl_in_reward=true algorithm.kl_coef=... instead")),
    "--entropy-coef": (True, to("algorithm.entropy_coeff", float)),
    "--eps-clip": (True, _clip("low")),
    "--eps-clip-high": (True, _clip("high")),
    "--eps-clip-c": (True, to("algorithm.clip_ratio_c", float)),
    "--use-tis": (False, lambda v, ctx: [("algorithm.tis_cap", float(ctx.get("--tis-clip", 2.0)))]),
    "--tis-clip": (True, lambda v, ctx: [("", "with --use-tis")] if "--use-tis" in ctx else [("", "unused: no --use-tis")]),
    "--optimizer": (True, only(lambda v: v == "adam", "Adam (mgrpo's optimizer)", "mgrpo trains with Adam")),
    "--lr": (True, to("actor.lr", float)),
    "--min-lr": (True, to("actor.min_lr", float)),
    "--lr-decay-style": (True, to("actor.lr_decay_style")),
    "--lr-warmup-iters": (True, to("actor.lr_warmup_steps", int)),
    "--weight-decay": (True, to("actor.weight_decay", float)),
    "--adam-beta1": (True, to("actor.adam_beta1", float)),
    "--adam-beta2": (True, to("actor.adam_beta2", float)),
    "--adam-eps": (True, to("actor.adam_eps", float)),
    "--clip-grad": (True, to("actor.grad_clip", float)),
    "--actor-num-nodes": (True, _placement),
    "--actor-num-gpus-per-node": (True, _placement),
    "--rollout-num-gpus": (True, _placement),
    "--colocate": (False, _placement),
    "--rollout-num-gpus-per-engine": (True, to("rollout.tp", int)),
    "--sglang-mem-fraction-static": (True, to("rollout.gpu_memory_utilization", float)),
    "--custom-rm-path": (True, _custom_rm),
    "--custom-reward-post-process-path": (True, refuse("slime's reward post-processing hook; mgrpo computes GRPO's "
                                                       "advantages itself (algorithm.adv_estimator)")),
    "--rm-url": (True, refuse(EXTERNAL)),
    "--opd-teacher-url": (True, _opd_flag(refuse(EXTERNAL))),
    "--use-opd": (False, _opd),
    "--opd-type": (True, _opd_flag(_opd_type)),
    "--opd-kl-coef": (True, _opd_flag(to("algorithm.opd.coef", float))),
    "--opd-teacher-load": (True, _opd_flag(_teacher_load)),
    "--opd-teacher-ckpt-step": (True, _opd_flag(refuse("a Hugging Face folder has no steps: export the step you "
                                                         "want and name its folder in --opd-teacher-load"))),
    "--opd-only-reward": (False, _opd_flag(lambda v, ctx: [("algorithm.adv_estimator", "none")])),
    "--use-wandb": (False, ignore(LOGGER)),
    "--wandb-project": (True, ignore(LOGGER)),
    "--wandb-group": (True, ignore(LOGGER)),
    "--wandb-key": (True, ignore(LOGGER)),
    "--attention-dropout": (True, only(lambda v: float(v) == 0, "no dropout (mgrpo's)", "mgrpo trains without dropout")),
    "--hidden-dropout": (True, only(lambda v: float(v) == 0, "no dropout (mgrpo's)", "mgrpo trains without dropout")),
    "--accumulate-allreduce-grads-in-fp32": (False, ignore(MEGATRON)),
    "--attention-softmax-in-fp32": (False, ignore(MEGATRON)),
    "--attention-backend": (True, ignore(SPEED)),
    # the architecture (slime's scripts/models/*.sh): checked against config.json by Hydra's composition
    "--num-layers": (True, to("model.num_layers", int)),
    "--hidden-size": (True, to("model.hidden_size", int)),
    "--ffn-hidden-size": (True, to("model.ffn_hidden_size", int)),
    "--num-attention-heads": (True, to("model.num_attention_heads", int)),
    "--num-query-groups": (True, to("model.num_query_groups", int)),
    "--kv-channels": (True, to("model.head_dim", int)),
    "--norm-epsilon": (True, to("model.rms_norm_eps", float)),
    "--rotary-base": (True, to("model.rope_theta", float)),
    "--vocab-size": (True, to("model.vocab_size", int)),
    "--untie-embeddings-and-output-weights": (False, lambda v, ctx: [("model.tie_word_embeddings", False)]),
    "--num-experts": (True, to("model.num_experts", int)),
    "--moe-ffn-hidden-size": (True, to("model.moe_ffn_hidden_size", int)),
    "--moe-router-topk": (True, to("model.moe_router_topk", int)),
    "--moe-aux-loss-coeff": (True, to("model.router_aux_loss_coef", float)),
    **{f: (False, ignore(ARCH)) for f in ("--swiglu", "--group-query-attention", "--use-rotary-position-embeddings",
                                          "--disable-bias-linear", "--qk-layernorm", "--moe-grouped-gemm")},
    "--normalization": (True, only(lambda v: v == "RMSNorm", ARCH, "Qwen3 uses RMSNorm")),
    "--position-embedding-type": (True, only(lambda v: v == "rope", ARCH, "Qwen3 uses rope")),
}
PLACEMENT = ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--colocate")
DEFAULT_DIFFS = (
    ("--use-kl-loss", "off", "algorithm.use_kl_loss", "true"),
    ("--entropy-coef", "0.0", "algorithm.entropy_coeff", "0.01"),
    ("--apply-chat-template", "off", "data.apply_chat_template", "true"),
    ("--rollout-shuffle", "off", "data.shuffle", "true"),
)
"""slime defaults that differ from mgrpo's, said when a slime line leaves the flag out."""


def split(argv: Sequence[str], own: Mapping[str, bool] = {}) -> tuple[list[tuple[str, Optional[str]]], list[str]]:
    """slime's flags as (name, value or None) and everything else (Hydra's flags, the launcher's `own` flags
    (name -> takes a value) and overrides) in order."""
    flags, rest, i = [], [], 0
    while i < len(argv):
        tok = argv[i]
        name, eq, value = tok.partition("=")
        if not tok.startswith("--") or name in HYDRA_FLAGS or name in own:
            rest.append(tok)
            if name in VALUE_FLAGS or own.get(name) or (name in ("--info", "-i") and i + 1 < len(argv)
                                                         and argv[i + 1] in INFO_CHOICES):
                if not eq and i + 1 < len(argv):
                    rest.append(argv[i + 1])
                    i += 1
            i += 1
            continue
        takes = FLAGS[name][0] if name in FLAGS else None
        if not eq and takes is not False and i + 1 < len(argv) and not argv[i + 1].startswith("--") \
                and (takes or "=" not in argv[i + 1]):
            value, i = argv[i + 1], i + 1
        elif not eq:
            value = None
        flags.append((name, value))
        i += 1
    return flags, rest


def translate(argv: Sequence[str], own: Mapping[str, bool] = {}) -> Translation:
    """Rewrite a command line that may hold slime flags into mgrpo overrides (the rest passes untouched).
    Raises SlimeFlagError naming every flag that cannot be honoured."""
    flags, rest = split(argv, own)
    out = Translation(args=list(rest))
    if not flags:
        return out
    last = {name: i for i, (name, _) in enumerate(flags)}
    for name in sorted({n for i, (n, _) in enumerate(flags) if last[n] != i}):
        out.notes.append(f"{name} is given more than once: the last is taken (argparse's rule, as slime reads it)")
    flags = [f for i, f in enumerate(flags) if last[f[0]] == i]
    ctx = {name: value for name, value in flags}
    ctx.update({tok.split("=", 1)[0]: tok.split("=", 1)[1] for tok in rest if "=" in tok and not tok.startswith("-")})
    errors, produced = [], {}
    typed = {tok.split("=", 1)[0] for tok in rest if "=" in tok and not tok.startswith("-")}

    def emit(key, value, source):
        if key in produced and produced[key][0] != value:
            errors.append(f"{source} and {produced[key][1]} both set {key}, to {value!r} and {produced[key][0]!r}")
        if key in typed:
            errors.append(f"{source} sets {key}, which the line also sets as {key}=...: keep one")
        produced[key] = (value, source)

    for name, value in flags:
        shown = f"{name} {value}" if value is not None else name
        if name not in FLAGS:
            errors.append(f"{shown}: no mgrpo equivalent (not translated); remove it")
            continue
        takes, rule = FLAGS[name]
        if takes and value is None:
            errors.append(f"{name}: needs a value")
            continue
        if not takes and value is not None:
            errors.append(f"{name}={value}: a switch takes no value")
            continue
        try:
            results = rule(value if value is None else str(value), ctx)
        except (Refuse, ValueError) as r:
            errors.append(f"{shown}: {r}")
            continue
        for k, v in results:
            if k:
                emit(k, v, shown)
        out.rows.append((shown, "; ".join(f"{k}={hydra_value(v)}" if k else f"ignored: {v}" for k, v in results)))
    if any(p in ctx for p in PLACEMENT):
        try:
            keys = placement(ctx)
        except Refuse as r:
            errors.append(f"placement: {r}")
        else:
            for k, v in keys:
                emit(k, v, "(placement)")
            out.rows.append(("(slime's placement)", " ".join(f"{k}={hydra_value(v)}" for k, v in keys)))
            if resolved_device("auto") == "cuda" and not any(t.startswith("cluster=") for t in rest):
                emit("cluster", "gpu", "(placement)")
    if errors:
        raise SlimeFlagError("cannot honour these slime flags (remove or change them):\n  - " + "\n  - ".join(errors))
    for flag, theirs, ours, our_default in DEFAULT_DIFFS:
        if flag not in ctx and ours not in ctx:
            out.notes.append(f"{flag} is not given: slime's default is {theirs}, mgrpo's {ours} is {our_default} "
                             "(say it to match slime)")
    # the translated keys first, then the line's own flags and overrides (a key set by both was refused above)
    out.args = [f"{k}={v}" if k == "cluster" else f"{k}={hydra_value(v)}" for k, (v, _) in produced.items()] + out.args
    return out


def render(t: Translation) -> str:
    width = min(max((len(v) for v, _ in t.rows), default=0), 48)
    return "\n".join(["slime command line translated (slime flag -> mgrpo key):",
                      *(f"  {v:<{width}} -> {m}" for v, m in t.rows), *(f"  note: {n}" for n in t.notes)])
