"""On-policy distillation's teacher, as the loop sees it: `send(exp)` starts the teacher's log-probs of the
student's sampled tokens and returns a function that waits for {'logprobs': per sample}.

Two teachers, as slime has them (--opd-type): a Megatron model in the actor's ranks (`MegatronTeacher`, laid out
and sharded like the reference), or auxiliary SGLang engines asked for the log-probs of the student's tokens
(`SGLangTeacher`: SGLang's `return_logprob` with `logprob_start_len`, the response tokens' `input_token_logprobs`).
Either way the values come back per response token in the experience's order, with the supports the student
sampled from applied (algorithm.logprob_support=sampled) where the teacher can take them.
"""

from __future__ import annotations

import os
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



class SGLangTeacher:
    """Teacher engines of their own (teacher.num_engines SGLang servers of teacher.hf_path, hosted as reward models
    are: `AuxEngineHosts`, frozen, never given weights). Each sample goes out as prompt + response with
    max_new_tokens=0, return_logprob and logprob_start_len = prompt length - 1, so `input_token_logprobs` holds
    [None, the response tokens' log-probs...] (SGLang puts None first: logprob_result_processor.py); a step's
    samples are cut into one batch per engine, sent at once from a thread each."""

    def __init__(self, cfg, *, api_key, log_dir: str, cpus: float = 1):
        from concurrent.futures import ThreadPoolExecutor

        from mgrpo.cluster.aux_engines import AuxEngineHosts
        from mgrpo.rollout.sglang import SGLangEngine

        t = cfg.teacher
        self.cfg, self.timeout_s = t, t.request_timeout_s
        client = dict(request_timeout_s=t.request_timeout_s, max_retries=cfg.rollout.max_retries, api_key=api_key)
        kwargs = [dict(tp=t.tp, mem_fraction_static=t.gpu_memory_utilization, enable_memory_saver=False,
                       extra_args=[], log_dir=os.path.join(log_dir, f"teacher-{k}"), **client)
                  for k in range(t.num_engines)]
        self.hosts = AuxEngineHosts("teacher", "sglang", t.hf_path, kwargs, cpus=cpus, tp=t.tp,
                                    timeout_s=t.request_timeout_s)
        self.engines = [SGLangEngine.connect(url, **client) for url in self.hosts.urls]
        self.pool = ThreadPoolExecutor(len(self.engines), thread_name_prefix="mgrpo-teacher")

    def send(self, exp: "Experience") -> Callable[[], dict]:
        n = len(exp)
        cuts = [range(k * n // len(self.engines), (k + 1) * n // len(self.engines)) for k in range(len(self.engines))]
        futures = [self.pool.submit(self.logprobs, engine, [exp.prompt_ids[i] for i in idx],
                                    [exp.response_ids[i] for i in idx]) for engine, idx in zip(self.engines, cuts)]

        def collect() -> dict:
            return {"logprobs": [row for f in futures for row in f.result(timeout=self.timeout_s * 2)]}

        return collect

    @staticmethod
    def logprobs(engine, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
        """One /generate batch: the teacher's log-prob of every response token given what precedes it."""
        from mgrpo.rollout.sglang.http import SGLangBadResponseError

        if not prompts:
            return []
        body = {"input_ids": [list(p) + list(r) for p, r in zip(prompts, responses)],
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": [len(p) - 1 for p in prompts]}
        items = engine.client.json("POST", "/generate", body)
        if not isinstance(items, list) or len(items) != len(prompts):
            raise SGLangBadResponseError(f"teacher /generate answered {type(items).__name__} for {len(prompts)} "
                                         "samples")
        out = []
        for item, r in zip(items, responses):
            got = ((item or {}).get("meta_info") or {}).get("input_token_logprobs")
            if not isinstance(got, list) or len(got) != len(r) + 1:
                raise SGLangBadResponseError(f"teacher /generate: input_token_logprobs of {len(r) + 1} positions "
                                             f"expected, got {str(got)[:200]}")
            out.append([float(v) for v, *_ in got[1:]])
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.hosts.close()


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
