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

