"""What an engine call's requests and results cost to cross Ray, as dataclasses and as columns
(`rollout/types.py::to_columns`, what `EngineSlot.generate` takes and answers).

    python -m benchmarks.measure.engine_call                  # writes outputs/benchmarks/engine_call_cpu.json
    python -m benchmarks.measure.engine_call --update-results

A local Ray (2 CPUs) and one actor with the engine host's concurrency groups, whose method answers at once: the
round trip (submit, pickle, run, pickle back, unpickle) of a call carrying the tiny workload's chunk (256 requests of
5 prompt tokens, 256 results of 4 tokens) and the Qwen3-vocabulary one's (64 requests of 150 tokens, 64 results of
128 tokens with their log-probs), either as GenerateRequest/GenerateResult objects or as `to_columns` lists with
`from_columns` on both ends, alternating; and an empty call. Medians in ms over --calls calls. Asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks import add_output_args, write_json
from benchmarks.tools.proctree import machine

SHAPES = {"tiny": (256, 5, 4), "qwen3vocab": (64, 150, 128)}
"""name -> (rows, prompt tokens, response tokens)."""


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200)
    add_output_args(ap, "engine_call_cpu")
    a = ap.parse_args(argv)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # as mgrpo's own local Ray (cluster/ray_env.py)
    import ray

    from mgrpo.cluster.engine_host import ENGINE_GROUPS
    from mgrpo.rollout.types import GenerateRequest, GenerateResult, SamplingParams, from_columns, to_columns

    @ray.remote(concurrency_groups=ENGINE_GROUPS)
    class Host:
        def __init__(self, response: int):
            self.response = response

        def _answer(self, requests) -> list:
            return [GenerateResult(uid=r.uid, token_ids=list(range(self.response)),
                                   logprobs=[-0.5] * self.response, finish_reason="stop", weight_version=1)
                    for r in requests]

        @ray.method(concurrency_group="engine")
        def objects(self, requests, sampling):
            return self._answer(requests)

        @ray.method(concurrency_group="engine")
        def columns(self, requests, sampling):
            return to_columns(self._answer(from_columns(GenerateRequest, requests)))

        @ray.method(concurrency_group="engine")
        def empty(self):
            return None

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    out = {"machine": machine(packages=("ray",)), "calls": a.calls,
           "command": "python -m benchmarks.measure.engine_call " + " ".join(argv or sys.argv[1:]), "shapes": {}}
    try:
        sampling = SamplingParams(max_new_tokens=4)

        def ms(call) -> float:
            t0 = time.perf_counter()
            call()
            return (time.perf_counter() - t0) * 1e3

        for name, (rows, prompt, response) in SHAPES.items():
            host = Host.remote(response)
            requests = [GenerateRequest(uid=i, prompt_ids=list(range(prompt))) for i in range(rows)]
            as_objects = lambda: ray.get(host.objects.remote(requests, sampling))  # noqa: E731
            as_columns = lambda: from_columns(GenerateResult,  # noqa: E731
                                              ray.get(host.columns.remote(to_columns(requests), sampling)))
            assert as_objects() == as_columns()  # the same results either way
            times: dict[str, list[float]] = {"objects": [], "columns": [], "empty": []}
            for _ in range(a.calls):  # alternating, so load reaches all three alike
                times["objects"].append(ms(as_objects))
                times["columns"].append(ms(as_columns))
                times["empty"].append(ms(lambda: ray.get(host.empty.remote())))
            row = {k: round(statistics.median(v), 3) for k, v in times.items()}
            row.update(rows=rows, prompt_tokens=prompt, response_tokens=response)
            out["shapes"][name] = row
            print(name, " ".join(f"{k}={v}" for k, v in row.items()))
            ray.kill(host)
    finally:
        ray.shutdown()
    write_json(a, "engine_call_cpu", out)


if __name__ == "__main__":
    main()
