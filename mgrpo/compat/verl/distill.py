"""veRL's on-policy distillation keys (distillation.*) -> mgrpo's teacher.* and algorithm.opd.*; part of the key
table in rules.py.

veRL serves its teacher on inference engines of its own (`distillation.teacher_models.<name>`, or the older single
`distillation.teacher_model`): in mgrpo that is `teacher.mode=sglang` (teacher.num_engines SGLang servers of
teacher.tp accelerators). Its loss settings (`distillation.distillation_loss.*`) map as:
  - loss_mode=forward_kl_topk (use_policy_gradient false: the loss backpropagated directly) -> algorithm.opd.loss_mode=
    forward_kl_topk, topk -> algorithm.opd.topk;
  - loss_mode=k1 / kl with use_policy_gradient true (the reverse-KL estimate as a reward) -> reverse_kl, mgrpo's
    advantage form;
  - use_task_rewards=false -> algorithm.adv_estimator=none (the teacher alone); distillation_loss_coef ->
    algorithm.opd.coef (veRL reads it only with task rewards, and uses 1.0 otherwise);
  - loss_max_clamp, log_prob_min_clamp -> algorithm.opd.*.
Other estimators (k3, low_var_kl, ... as direct losses), a policy-gradient form of forward_kl_topk and more than
one teacher are refused by name.
"""

from __future__ import annotations

from mgrpo.compat.verl.kit import TUNING, Refuse, Rule, falsy, ignore

D = "distillation."
LOSS = D + "distillation_loss."
TEACHERS = D + "teacher_models."
OLD_TEACHER = D + "teacher_model."
OFF = "unused: distillation.enabled is not true"
PLACED = ("mgrpo gives the teacher engines accelerators of their own: teacher.num_engines x teacher.tp "
          "(teacher.num_engines from num_replicas / num_workers, teacher.tp from the inference TP size)")


def enabled(ctx) -> bool:
    return not falsy(ctx.get(D + "enabled", False))


def teacher_names(ctx) -> list[str]:
    """The teachers a line names, in the order it names them (teacher_models.<name>.*)."""
    names: list[str] = []
    for key in ctx:
        if key.startswith(TEACHERS) and key.count(".") >= 3:
            name = key[len(TEACHERS):].split(".")[0]
            if name not in names:
                names.append(name)
    return names


def task_rewards(ctx) -> bool:
    return not falsy(ctx.get(LOSS + "use_task_rewards", True))


def _on(rule: Rule) -> Rule:
    """`rule` when distillation.enabled is true; accepted and unused otherwise."""
    return lambda v, ctx: rule(v, ctx) if enabled(ctx) else [("", OFF)]


def _enabled(v, ctx):
    if falsy(v):
        return [("", "off: no teacher, as mgrpo without teacher.hf_path")]
    if not any(k.endswith(".model_path") and (k.startswith(TEACHERS) or k.startswith(OLD_TEACHER)) for k in ctx):
        raise Refuse(f"on-policy distillation needs a teacher: set {TEACHERS}<name>.model_path")
    return [("", "on: the teacher and loss keys below")]


def _loss_mode(v, ctx):
    pg = ctx.get(LOSS + "use_policy_gradient")
    if v == "forward_kl_topk":
        if pg is not None and not falsy(pg):
            raise Refuse("forward_kl_topk as a policy-gradient reward has no mgrpo equivalent: mgrpo backpropagates it "
                         f"directly; set {LOSS}use_policy_gradient=false")
        return [("algorithm.opd.loss_mode", "forward_kl_topk")]
    if v in ("k1", "kl"):
        if pg is not None and falsy(pg):
            raise Refuse("k1 backpropagated directly carries no teacher gradient (veRL refuses it too); set "
                         f"{LOSS}use_policy_gradient=true")
        return [("algorithm.opd.loss_mode", "reverse_kl")]
    raise Refuse(f"{v!r}: mgrpo has the k1 reverse KL as an advantage term (loss_mode=k1, use_policy_gradient=true) "
                 "and forward_kl_topk as a loss term")


def _use_pg(v, ctx):
    mode = ctx.get(LOSS + "loss_mode")
    return [("", f"the form of loss_mode={mode} (translated with it)" if mode else
             f"set {LOSS}loss_mode too (k1 or forward_kl_topk)")]


def _task_rewards(v, ctx):
    if falsy(v):
        return [("algorithm.adv_estimator", "none")]
    return [("", "true: the reward's advantage plus the teacher's term, as mgrpo with a teacher")]


def _coef(v, ctx):
    if not task_rewards(ctx):
        return [("", "unused: veRL weighs the teacher's loss 1.0 without task rewards")]
    return [("algorithm.opd.coef", float(v))]


def _float_or_none(key: str) -> Rule:
    return lambda v, ctx: [(key, None if v is None else float(v))]


def _policy_loss_mode(v, ctx):
    if v != "vanilla":
        raise Refuse(f"{v!r}: the teacher's term rides in mgrpo's own policy loss (algorithm.policy_loss)")
    return [("", "vanilla: the teacher's term rides in mgrpo's policy loss")]


def _inference_name(v, ctx):
    if v != "sglang":
        raise Refuse(f"teacher engine {v!r}: mgrpo serves the teacher with SGLang; use inference.name=sglang")
    return [("teacher.mode", "sglang")]


LOSS_RULES: dict[str, Rule] = {
    LOSS + "loss_mode": _on(_loss_mode),
    LOSS + "topk": _on(lambda v, ctx: [("algorithm.opd.topk", int(v))]),
    LOSS + "use_policy_gradient": _on(_use_pg),
    LOSS + "use_task_rewards": _on(_task_rewards),
    LOSS + "distillation_loss_coef": _on(_coef),
    LOSS + "loss_max_clamp": _on(_float_or_none("algorithm.opd.loss_max_clamp")),
    LOSS + "log_prob_min_clamp": _on(_float_or_none("algorithm.opd.log_prob_min_clamp")),
    LOSS + "policy_loss_mode": _on(_policy_loss_mode),
    LOSS + "clip_ratio": ignore("the teacher's term rides in mgrpo's policy loss, clipped by algorithm.clip_ratio_*"),
    LOSS + "clip_ratio_low": ignore("the teacher's term rides in mgrpo's policy loss (algorithm.clip_ratio_low)"),
    LOSS + "clip_ratio_high": ignore("the teacher's term rides in mgrpo's policy loss (algorithm.clip_ratio_high)"),
    LOSS + "use_chunked_topk": ignore("mgrpo's top-k always holds one chunk of logits at a time"),
    LOSS + "chunked_topk_chunk_size": ignore("mgrpo's top-k chunk follows actor.logprob_chunk_tokens"),
}
TEACHER_RULES: dict[str, Rule] = {  # the part after teacher_models.<name>. (or teacher_model.)
    "model_path": lambda v, ctx: [("teacher.hf_path", str(v)), ("teacher.mode", "sglang")],
    "num_replicas": lambda v, ctx: [("teacher.num_engines", int(v))],
    "key": ignore("routes samples between several teachers; mgrpo distils from one"),
    "inference.name": _inference_name,
    "inference.tensor_model_parallel_size": lambda v, ctx: [("teacher.tp", int(v))],
    "inference.gpu_memory_utilization": lambda v, ctx: [("teacher.gpu_memory_utilization", float(v))],
    "enable_resource_pool": ignore(PLACED),
    "n_gpus_per_node": ignore(PLACED),
    "nnodes": ignore(PLACED),
}
DISTILL_RULES: dict[str, Rule] = {
    D + "enabled": _enabled,
    D + "n_gpus_per_node": ignore(PLACED),
    D + "nnodes": ignore(PLACED),
    D + "num_workers": _on(lambda v, ctx: [("teacher.num_engines", int(v))]),
    **LOSS_RULES,
}


def teacher_rule(key: str):
    """The rule of a teacher key (`distillation.teacher_models.<name>.<field>` or `distillation.teacher_model.<field>`),
    or None when the key is neither."""
    if key.startswith(OLD_TEACHER):
        name, tail = None, key[len(OLD_TEACHER):]
    elif key.startswith(TEACHERS) and key.count(".") >= 3:
        name, tail = key[len(TEACHERS):].split(".", 1)
    else:
        return None
    rule = TEACHER_RULES.get(tail) or (ignore(TUNING) if tail.startswith("inference.") else None)
    if rule is None:
        return None

    def rule_for_teacher(v, ctx):
        if not enabled(ctx):
            return [("", OFF)]
        names = teacher_names(ctx)
        if name is not None and len(names) > 1:
            if name != names[0] and tail == "model_path":
                raise Refuse(f"mgrpo distils from one teacher; this line names {len(names)} ({', '.join(names)})")
            if name != names[0]:
                return [("", f"teacher {name!r}: refused with its model_path")]
        return rule(v, ctx)

    return rule_for_teacher
