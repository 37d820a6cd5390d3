"""On-policy distillation's teacher, as the loop sees it: `send(exp)` starts the teacher's log-probs of the
student's sampled tokens and returns a function that waits for {'logprobs': per sample}.

Two teachers, as slime has them (--opd-type): a Megatron model in the actor's ranks (`MegatronTeacher`, laid out
and sharded like the reference), or auxiliary SGLang engines asked for the log-probs of the student's tokens
(`SGLangTeacher`: SGLang's `return_logprob` with `logprob_start_len`, the response tokens' `input_token_logprobs`).
Either way the values come back per response token in the experience's order, with the supports the student
sampled from applied (algorithm.logprob_support=sampled) where the teacher can take them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from mgrpo.experience import Experience


class MegatronTeacher:
    """The teacher model on the Megatron ranks (`MegatronActor.teacher`): one forward-only pass over the
    experience's shards, cut and put back in order by the actor client like the reference's."""

    def __init__(self, client):
        self.client = client

    def send(self, exp: "Experience") -> Callable[[], dict]:
        return self.client.send_logprobs(exp, "teacher")


def teacher_errors(cfg) -> list[str]:
    """What refuses a teacher at start: no checkpoint, another vocabulary or chat template than the student's
    (the teacher scores the student's token ids, which must mean the same text to both), a Megatron teacher the
    actor's layout cannot split, and a distillation setting without a teacher."""
    t, al = cfg.teacher, cfg.algorithm
    e: list[str] = []
    if al.opd.coef < 0:
        e.append(f"algorithm.opd.coef={al.opd.coef} must be non-negative")
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
    elif t.tp < 1 or t.num_engines < 1:
        e.append(f"teacher.tp={t.tp} and teacher.num_engines={t.num_engines} must be at least 1")
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
