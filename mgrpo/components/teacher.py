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

import numpy as np

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
        self.cfg, self.timeout_s, self.topk = t, t.request_timeout_s, cfg.algorithm.opd.teacher_topk
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
                                    [exp.response_ids[i] for i in idx], self.topk)
                   for engine, idx in zip(self.engines, cuts)]

        def collect() -> dict:
            rows = [row for f in futures for row in zip(*f.result(timeout=self.timeout_s * 2))]
            out = {"logprobs": [lp for lp, _ in rows]}
            if self.topk:
                out["topk_logprobs"] = [top[0] for _, top in rows]
                out["topk_ids"] = [top[1] for _, top in rows]
            return out

        return collect

    @staticmethod
    def logprobs(engine, prompts: list[list[int]], responses: list[list[int]], topk: int = 0):
        """One /generate batch: the teacher's log-prob of every response token given what precedes it, and
        with `topk` ([length, topk] log-probs float32, ids int32) its top log-probs at each response position
        (SGLang's top_logprobs_num: the response's entries of meta_info.input_top_logprobs, [logprob, id, text]
        triples highest first, the first entry None like input_token_logprobs'). Two lists, one row a sample."""
        from mgrpo.rollout.sglang.http import SGLangBadResponseError

        if not prompts:
            return [], []
        body = {"input_ids": [list(p) + list(r) for p, r in zip(prompts, responses)],
                "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
                "return_logprob": True, "logprob_start_len": [len(p) - 1 for p in prompts]}
        if topk:
            body["top_logprobs_num"] = topk
        items = engine.client.json("POST", "/generate", body)
        if not isinstance(items, list) or len(items) != len(prompts):
            raise SGLangBadResponseError(f"teacher /generate answered {type(items).__name__} for {len(prompts)} "
                                         "samples")
        out, tops = [], []
        for item, r in zip(items, responses):
            meta = (item or {}).get("meta_info") or {}
            got = meta.get("input_token_logprobs")
            if not isinstance(got, list) or len(got) != len(r) + 1:
                raise SGLangBadResponseError(f"teacher /generate: input_token_logprobs of {len(r) + 1} positions "
                                             f"expected, got {str(got)[:200]}")
            out.append([float(v) for v, *_ in got[1:]])
            if topk:
                top = meta.get("input_top_logprobs")
                if (not isinstance(top, list) or len(top) != len(r) + 1
                        or any(not isinstance(row, list) or len(row) != topk for row in top[1:])):
                    raise SGLangBadResponseError(f"teacher /generate: input_top_logprobs of {len(r) + 1} positions "
                                                 f"x {topk} expected, got {str(top)[:200]}")
                vals = [[float(e[0]) for e in row] for row in top[1:]]
                ids = [[int(e[1]) for e in row] for row in top[1:]]
                tops.append((np.array(vals, dtype=np.float32).reshape(len(r), topk),
                             np.array(ids, dtype=np.int32).reshape(len(r), topk)))
            else:
                tops.append(None)
        return out, tops

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.hosts.close()

