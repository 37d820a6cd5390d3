"""Preflight: everything that can be known to be wrong with a run before any process starts.

`mgrpo.config.validate` checks each field on its own terms; this module, one floor above the rooms, adds the
checks that ask them: names registered by the rooms that implement them (advantage estimators, policy losses,
KL estimators, loss aggregation modes, model families, synthetic tasks, reward functions) with their
metadata (an estimator that needs groups of n >= 2, a sequence-level loss that cannot be split over context
parallel ranks), the sandbox level the run names (when it names one: a trial sandbox is started), and the
memory plan's verdict. Every problem is reported in one ConfigError (the launchers exit with status 2).
`Trainer.__init__` and `mgrpo-plan` call it; each registry stays the one list of its names, and nothing here
copies one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from mgrpo.config import ConfigError, Layout, MGRPOConfig
from mgrpo.config.validate import field_errors, layout, raise_errors


def _registered(errors: list[str], name: str, value, registry):
    """The registry entry of `value`, or None after recording the error (which lists the registered names)."""
    message = registry.unknown(value, key=name)
    if message is not None:
        errors.append(message)
        return None
    return registry[value]


def registry_errors(cfg: MGRPOConfig) -> list[str]:
    """Named choices checked against the registries of the rooms that implement them."""
    from mgrpo.algorithms.registry import ADVANTAGE_ESTIMATORS, AGGREGATION_MODES, KL_ESTIMATORS, POLICY_LOSSES
    from mgrpo.data.synthetic import SYNTHETIC_TASKS
    from mgrpo.models.registry import FAMILIES
    from mgrpo.rewards.registry import BUILTIN_REWARDS, EVERY_SOURCE

    e: list[str] = []
    al, a, d, r = cfg.algorithm, cfg.actor, cfg.data, cfg.rollout
    family = _registered(e, "model.family", cfg.model.family, FAMILIES)
    if family is not None:  # what the family cannot build from the model.* fields (e.g. experts of a dense one)
        e.extend(family.config_errors(cfg.model))
    e.extend(_router_replay_errors(cfg, family))
    estimator = _registered(e, "algorithm.adv_estimator", al.adv_estimator, ADVANTAGE_ESTIMATORS)
    loss = _registered(e, "algorithm.policy_loss", al.policy_loss, POLICY_LOSSES)
    _registered(e, "algorithm.kl_loss_type", al.kl_loss_type, KL_ESTIMATORS)
    _registered(e, "algorithm.kl_penalty", al.kl_penalty, KL_ESTIMATORS)
    _registered(e, "algorithm.loss_agg_mode", al.loss_agg_mode, AGGREGATION_MODES)
    if estimator is not None and estimator.needs_groups and r.n < 2:
        e.append(f"rollout.n={r.n} must be at least 2 for algorithm.adv_estimator={al.adv_estimator!r} "
                 "(advantages are relative to the prompt group)")
    if loss is not None and a.cp > 1 and not loss.token_level:
        e.append(f"actor.cp={a.cp} splits every response over CP ranks, but algorithm.policy_loss="
                 f"{al.policy_loss!r} is sequence-level and needs each whole response on one rank "
                 "(use actor.cp=1 or a token-level loss such as vanilla)")
    if not d.train_files and d.synthetic_task is None:
        e.append("data.train_files is empty and data.synthetic_task is null: give the records to train on "
                 "(data.train_files=[my.jsonl]) or a built-in task (data.synthetic_task=sum)")
    elif not d.train_files:
        task = _registered(e, "data.synthetic_task", d.synthetic_task, SYNTHETIC_TASKS)
        if (task is not None and task.data_source not in BUILTIN_REWARDS
                and not {task.data_source, EVERY_SOURCE} & set(cfg.reward.custom_functions)):
            e.append(f"data.synthetic_task={d.synthetic_task!r} makes records of data_source {task.data_source!r}, "
                     "which has no reward function; add one with reward.custom_functions")
    return e


def engine_errors(cfg: MGRPOConfig) -> list[str]:
    """What the rollout engine would refuse on every request (better said now than at the first step)."""
    r = cfg.rollout
    if r.engine != "sglang" or cfg.algorithm.logprob_support != "sampled":
        return []  # before the imports: they bring torch, which mgrpo-plan does not otherwise load
    from mgrpo.rollout.sglang.generate_io import needs_mask
    from mgrpo.rollout.types import SamplingParams

    try:  # SGLang returns a sampling support only for a finite top_k (its --sampling-mask-max-tokens)
        needs_mask(SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, return_support=True))
    except ValueError as err:
        return [f"algorithm.logprob_support=sampled with rollout.engine=sglang: {err}"]
    return []


def sandbox_errors(cfg: MGRPOConfig) -> list[str]:
    """The sandbox level this machine cannot give, for a run that names one (sandbox.isolation=bwrap|unshare)
    or gives the model the code tool (auto: no level works). A trial sandbox starts here, a fraction of a
    second, so that a run refused for its sandbox is refused before Ray and the models start; the result is
    kept for the process, where the sandbox is then made. A run without the code tool on `auto` pays nothing."""
    from mgrpo.sandbox.tool import gives_code_tool

    if cfg.sandbox.isolation == "auto" and not gives_code_tool(cfg.rollout.multi_turn):
        return []
    from mgrpo.config.validate import InputError
    from mgrpo.sandbox.probe import resolve

    try:
        resolve(cfg.sandbox.isolation)
    except InputError as e:
        return [str(e)]
    return []


def placement_errors(cfg: MGRPOConfig, lay: Layout) -> list[str]:
    """A GPU layout that the Ray this run starts on this machine (no trainer.ray_address) cannot place: Ray
    would wait for bundles that never fit and end in a traceback. A CPU run's Ray is given exactly the slots
    it needs, and a cluster's (trainer.ray_address) resources are not this machine's: both pass."""
    from mgrpo.config.validate import resolved_device

    t = cfg.trainer
    if t.ray_address or resolved_device(t.device) != "cuda":
        return []
    if resolved_device("auto") != "cuda":
        return [f"trainer.device=cuda (cluster=gpu) but this machine has no NVIDIA GPU and trainer.ray_address "
                f"names no cluster: {lay.megatron_world} trainer rank(s) cannot be placed (use cluster=local_cpu, "
                "or trainer.ray_address of a GPU cluster)"]
    from mgrpo.cluster.placement import bundle_count

    bundles, have = bundle_count(cfg, lay, gpus=True), os.cpu_count() or 1
    if bundles * t.cpus_per_worker > have:
        return [f"trainer.cpus_per_worker={t.cpus_per_worker}: the run's {bundles} Ray bundles ({lay.megatron_world} "
                f"trainer rank(s) and its engines) need {bundles * t.cpus_per_worker} CPUs, this machine has {have} "
                f"(lower trainer.cpus_per_worker to {max(have // bundles, 1)} or fewer, or use trainer.ray_address)"]
    return []


def _router_replay_errors(cfg: MGRPOConfig, family) -> list[str]:
    """actor.router_replay needs routers (a mixture-of-experts family) and, to replay the rollout's routes,
    an engine that returns them (`EngineSpec.returns_routes`)."""
    from mgrpo.rollout.factory import ENGINES

    mode, e = str(cfg.actor.router_replay), []
    if mode == "off":
        return e
    if family is not None and not family.has_experts:
        e.append(f"actor.router_replay={mode!r} replays mixture-of-experts routing, but model.family="
                 f"{cfg.model.family!r} has no experts (use actor.router_replay=off)")
    spec = ENGINES.get(str(cfg.rollout.engine))
    if mode == "rollout" and spec is not None and not spec.returns_routes:
        engines = sorted(n for n, s in ENGINES.items() if s.returns_routes)
        e.append(f"actor.router_replay='rollout' replays the experts the rollout engine chose, but rollout.engine="
                 f"{cfg.rollout.engine!s} does not return them (engines that do: {engines}; or "
                 "actor.router_replay=old)")
    return e


def teacher_errors(cfg) -> list[str]:
    """What refuses a teacher at start: no checkpoint, another vocabulary or chat template than the student's
    (the teacher scores the student's token ids, which must mean the same text to both), a Megatron teacher the
    actor's layout cannot split, and a distillation setting without a teacher."""
    t, al = cfg.teacher, cfg.algorithm
    e: list[str] = []
    if al.opd.coef < 0:
        e.append(f"algorithm.opd.coef={al.opd.coef} must be non-negative")
    if al.opd.loss_mode == "forward_kl_topk":
        if al.opd.topk < 1 or al.opd.topk > cfg.model.vocab_size:
            e.append(f"algorithm.opd.topk={al.opd.topk} must be between 1 and model.vocab_size="
                     f"{cfg.model.vocab_size}")
        if al.logprob_support == "sampled":
            e.append("algorithm.opd.loss_mode=forward_kl_topk compares whole-vocabulary top-k log-probs, not "
                     "log-probs over each token's sampling support (algorithm.logprob_support=sampled)")
    if not t.hf_path:
        if al.adv_estimator == "none":
            e.append("algorithm.adv_estimator=none trains on on-policy distillation's teacher term alone, but "
                     "teacher.hf_path is not set")
        return e
    from mgrpo.config import ConfigError, InputError
    from mgrpo.data.tokenizer import load_tokenizer
    from mgrpo.models.hf_config import teacher_model

    try:
        model = teacher_model(t.hf_path)
    except (FileNotFoundError, InputError, ValueError) as err:
        return e + [f"teacher.hf_path={t.hf_path!r}: {err}"]
    if model.vocab_size != cfg.model.vocab_size:
        e.append(f"teacher.hf_path={t.hf_path!r} has vocab_size={model.vocab_size} but the student "
                 f"(model.tokenizer={cfg.model.tokenizer!r}) has model.vocab_size={cfg.model.vocab_size}: "
                 "the teacher must share the student's tokenizer")
    try:
        student, teacher = load_tokenizer(cfg.model), load_tokenizer(model)
    except (ConfigError, OSError, ValueError) as err:
        return e + [f"teacher.hf_path={t.hf_path!r}: its tokenizer cannot be loaded ({err})"]
    e.extend(tokenizer_differences(student, f"the student's (model.tokenizer={cfg.model.tokenizer!r})",
                                   teacher, f"the teacher's (teacher.hf_path={t.hf_path!r}, tokenizer "
                                   f"{model.tokenizer!r})"))
    if t.mode == "megatron":
        a = cfg.actor
        if model.num_layers % a.pp:
            e.append(f"teacher.mode=megatron lays the teacher out like the actor: its {model.num_layers} layers "
                     f"({t.hf_path}) do not split over actor.pp={a.pp} stages")
        if model.num_query_groups % a.tp or model.num_attention_heads % a.tp:
            e.append(f"teacher.mode=megatron lays the teacher out like the actor: its {model.num_attention_heads} "
                     f"heads / {model.num_query_groups} key-value heads do not split over actor.tp={a.tp}")
    else:
        if t.tp < 1 or t.num_engines < 1:
            e.append(f"teacher.tp={t.tp} and teacher.num_engines={t.num_engines} must be at least 1")
        # SGLang's input-token log-probs are log_softmax of the raw logits over the whole vocabulary
        # (logprob_processor.py): neither tempered nor over a sampling support
        if cfg.rollout.temperature != 1.0:
            e.append(f"teacher.mode=sglang returns untempered log-probs (SGLang's input_token_logprobs), but "
                     f"rollout.temperature={cfg.rollout.temperature}: use teacher.mode=megatron, whose forward "
                     "takes the rollout temperature")
        if al.logprob_support == "sampled":
            e.append("teacher.mode=sglang returns log-probs over the whole vocabulary, not over each token's "
                     "sampling support (algorithm.logprob_support=sampled): use teacher.mode=megatron")
    return e


def tokenizer_differences(a, a_name: str, b, b_name: str) -> list[str]:
    """One line per way two tokenizers differ (vocabulary, special tokens' ids, chat template), naming both."""
    e: list[str] = []
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        differ = sorted(set(va.items()) ^ set(vb.items()), key=lambda kv: kv[1])[:3]
        e.append(f"{b_name} vocabulary ({len(vb)} tokens) differs from {a_name} ({len(va)} tokens), e.g. "
                 f"{differ}: on-policy distillation needs the student's tokenizer in the teacher")
    if (a.chat_template or None) != (b.chat_template or None):
        e.append(f"{b_name} chat template differs from {a_name}: the teacher would read the student's prompts "
                 "as another conversation")
    return e


@dataclass(frozen=True)
class Checked:
    layout: Layout
    """How the accelerators are split."""
    memory: Optional[object]
    """The memory plan's verdict (`mgrpo.plan.memory.Verdict`); None when not asked for."""


def preflight(cfg: MGRPOConfig, *, check_files: bool = True, check_memory: bool = True,
              check_placement: bool = True) -> Checked:
    """Raise ConfigError naming every problem of `cfg`; return its layout (and memory verdict) otherwise.
    With `check_memory`, a run the memory plan says cannot fit fails here too, unless
    trainer.allow_oversubscribe (mgrpo-plan prints the whole plan). With `check_placement`, a layout the Ray
    this run would start on this machine cannot place fails here too (`placement_errors`)."""
    raise_errors(field_errors(cfg, check_files=check_files) + registry_errors(cfg) + engine_errors(cfg)
                 + sandbox_errors(cfg) + teacher_errors(cfg))
    if check_placement:  # a run about to start Ray here (mgrpo-plan plans for other machines too)
        raise_errors(placement_errors(cfg, layout(cfg)))  # needs a layout: after the field errors
    memory = None
    if check_memory:
        from mgrpo.plan.memory import check_fits

        memory = check_fits(cfg)
    return Checked(layout(cfg), memory)


__all__ = ["Checked", "ConfigError", "engine_errors", "placement_errors", "preflight", "registry_errors",
           "sandbox_errors", "teacher_errors"]
