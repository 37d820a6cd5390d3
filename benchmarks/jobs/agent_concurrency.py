"""Per-trajectory concurrency against turn-lockstep batching for multi-turn tool rollouts.

    python -m benchmarks.jobs.agent_concurrency                    # -> outputs/benchmarks/agent_concurrency_cpu.*
    python -m benchmarks.jobs.agent_concurrency --update-results   # -> benchmarks/results/agent_concurrency_cpu.*

A step's 256 trajectories on the printable tokenizer's Qwen3-style template, at most 64 in flight
(rollout.multi_turn.max_concurrent_per_engine=64, one engine), under two workloads (--workloads):
  - uniform: every trajectory makes 3 tool calls, then answers (4 assistant turns); the tool sleeps a latency
    drawn per call from [0.5, 1.5] x L. The kindest workload for lockstep: every trajectory has the same length
    and a turn's slowest call is at most 1.5x the mean.
  - agentic: each trajectory makes 1 to 5 tool calls (drawn per trajectory, mean 3, as a policy decides how long
    to look), and the latency is log-normal with mean L and sigma 1 (median 0.61 L, 99th percentile 6.2 L: the
    long tail of code execution and search calls). What agent RL steps look like; here a lockstep batch waits
    for its longest trajectory and each of its turns for the slowest of up to 64 draws.
L = 50, 200, 500 ms. The engine is
simulated as a continuously batching server (SGLang's scheduler): one decode step at a time, each costing
STEP_MS + PER_REQUEST_MS x the requests running; a request sent while steps run joins at the next step and
leaves when its tokens are out; a call returns when all its requests are done; abort_all ends the running
requests at once (SGLang's /abort_request). So what is measured is the scheduling, nothing else:
  - lockstep: batches of 64; every turn, one generate for all live trajectories of the batch, then all their tool
    calls, and the next turn waits for the slowest call (TRL's GRPO trainer's multi-turn loop works this way);
    the next batch starts when the slowest trajectory of this one is done;
  - concurrent: mgrpo's AgentRunner (each trajectory its own coroutine; a slot freed by a finished trajectory
    starts the next one of the step at once; a ready turn is sent at once, joining the engine's running batch,
    without waiting for the calls in flight);
  - concurrent_over_sample: the same with rollout.over_sample_rate=0.1 (veRL's multi-turn examples' value): the
    step ends when int(256 x 0.9) = 230 trajectories are done (a few more when they finish in the same instant),
    the others are aborted (not trained on).
All use the same parser, template and tool code. Numbers: the batch's seconds, the trajectories kept (finished,
not aborted), kept trajectories/s and sampled tokens/s of the kept ones; each the median of --repeats runs of the
mode, interleaved with the others' (with the fastest and slowest run's seconds), since a shared machine's load
moves between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import threading
import time

from benchmarks import add_output_args, output_path
from mgrpo.agent.parse import ToolCallParser
from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.template import ChatTemplate
from mgrpo.agent.tools import BaseTool, ToolSet
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.data.printable import printable_tokenizer
from mgrpo.rollout.types import GenerateResult, SamplingParams

K, CAP, TURNS = 256, 64, 4
MAX_CALLS, SIGMA = 5, 1.0
WORKLOADS = ("uniform", "agentic")
STEP_MS, PER_REQUEST_MS = 1.0, 0.05
OVER_SAMPLE_RATE = 0.1
SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "Slow lookup.",
                                           "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'


class SlowTool(BaseTool):
    def __init__(self, latency_s: float, seed: int, workload: str = "uniform"):
        super().__init__({}, SCHEMA)
        self.latency_s, self.rng, self.workload = latency_s, random.Random(seed), workload

    def draw(self) -> float:
        if self.workload == "agentic":  # mean exp(mu + sigma^2 / 2) = latency
            return self.rng.lognormvariate(math.log(self.latency_s) - SIGMA ** 2 / 2, SIGMA)
        return self.latency_s * self.rng.uniform(0.5, 1.5)

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(self.draw())
        return "42", None, {}


def calls_per_trajectory(workload: str) -> list[int]:
    """How many tool calls each of the K trajectories makes before it answers (seeded, the same for every mode)."""
    if workload == "agentic":
        rng = random.Random(1)
        return [rng.randint(1, MAX_CALLS) for _ in range(K)]
    return [TURNS - 1] * K


class _Running:
    def __init__(self, tokens: list[int]):
        self.tokens, self.out, self.aborted = tokens, 0, False
        self.done = threading.Event()


class SimulatedEngine:
    """A continuously batching server (see the module docstring), driven by one scheduler thread."""

    def __init__(self, tok, prompts: list[list[int]], calls: list[int]):
        self.tok, self.calls, self.steps = tok, 0, 0
        # a request's trajectory by its prompt (all prompts have one length), and how many calls it makes
        self.width, self.plan = len(prompts[0]), {tuple(p): n for p, n in zip(prompts, calls)}
        self.call_ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        self.answer_ids = tok("It is 42.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        self.cond = threading.Condition()
        self.waiting: list[_Running] = []
        self.running: list[_Running] = []
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            with self.cond:
                while not self.stop and not self.waiting and not self.running:
                    self.cond.wait()
                if self.stop:
                    return
                self.running += self.waiting  # joins at the next step
                self.waiting = []
                n = len(self.running)
            time.sleep((STEP_MS + PER_REQUEST_MS * n) / 1000)
            with self.cond:
                self.steps += 1
                for r in self.running:
                    r.out += 1
                    if r.out >= len(r.tokens):
                        r.done.set()
                self.running = [r for r in self.running if not r.done.is_set()]

    def __call__(self, prompts, sampling, sessions=None):
        self.calls += 1
        reqs = []
        for ids in prompts:
            # assistant turns so far: the prompt ends 2 turns (system, user) with <|im_end|>, each tool round 2 more
            turns = (ids.count(self.tok.eos_token_id) - 2) // 2
            calls = self.plan[tuple(ids[:self.width])]
            reqs.append(_Running(self.call_ids if turns < calls else self.answer_ids))
        with self.cond:
            self.waiting += reqs
            self.cond.notify()
        for r in reqs:
            r.done.wait()
        return [GenerateResult(uid=0, token_ids=[] if r.aborted else list(r.tokens),
                               logprobs=[] if r.aborted else [-0.1] * len(r.tokens),
                               finish_reason="abort" if r.aborted else "stop", weight_version=0) for r in reqs], {}

    def abort_all(self):
        with self.cond:
            for r in self.waiting + self.running:
                r.aborted = True
                r.done.set()
            self.waiting, self.running = [], []

    def close(self):
        with self.cond:
            self.stop = True
            self.cond.notify()
        self.thread.join(timeout=10)


def _prompts(tok):
    return [tok(tok.apply_chat_template([{"role": "user", "content": f"q{i:03d}"}], tools=[SCHEMA], tokenize=False,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for i in range(K)]


def concurrent(tok, latency_s: float, workload: str, over_sample_rate: float = 0.0) -> tuple[float, int, int]:
    calls = calls_per_trajectory(workload)
    cfg = MultiTurnConfig(enable=True, max_assistant_turns=max(calls) + 1, function_tools=["x:y"],
                          max_concurrent_per_engine=CAP)
    runner = AgentRunner(cfg, tok, ToolSet([SlowTool(latency_s, 0, workload)]), max_response_length=4096)
    prompts = _prompts(tok)
    engine = SimulatedEngine(tok, prompts, calls)
    try:
        t0 = time.perf_counter()
        trajs, _ = runner.run([(p, {}, "") for p in prompts], SamplingParams(max_new_tokens=4096), engine,
                              over_sample_rate=over_sample_rate, abort=engine.abort_all)
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    kept = [(t, n) for t, n in zip(trajs, calls) if t.finish_reason != "aborted"]
    assert all(t.finish_reason == "stop" and len(t.turns) == 2 * n + 1 for t, n in kept)
    kept = [t for t, _ in kept]
    # at least veRL's target: trajectories that finished in the same instant as the target-th are kept, as in veRL
    assert len(kept) >= int(K * (1 - over_sample_rate)) and (over_sample_rate or len(kept) == K)
    return seconds, len(kept), sum(sum(t.sampled) for t in kept)


def lockstep(tok, latency_s: float, workload: str) -> tuple[float, int, int]:
    calls = calls_per_trajectory(workload)
    ids = _prompts(tok)
    tool, template, engine = SlowTool(latency_s, 0, workload), ChatTemplate(tok), SimulatedEngine(tok, ids, calls)
    parser = ToolCallParser("qwen25", [SCHEMA])
    sampled = 0
    try:
        t0 = time.perf_counter()
        for start in range(0, K, CAP):
            live = list(range(start, min(start + CAP, K)))
            while live:  # a turn for every live trajectory, until the batch's longest has answered
                results, _ = engine([ids[i] for i in live], SamplingParams(max_new_tokens=4096))
                calling = []
                for i, r in zip(live, results):
                    ids[i] = ids[i] + r.token_ids
                    sampled += len(r.token_ids)
                    if parser.parse(tok.decode(r.token_ids).removesuffix(tok.eos_token)).calls:
                        calling.append(i)

                async def run_all():
                    return await asyncio.gather(*(tool.execute("i", {}) for _ in calling))

                replies = asyncio.run(run_all())  # the turn waits for its slowest call
                for i, (text, _, _) in zip(calling, replies):
                    ids[i] = ids[i] + template.tool_suffix([text])
                live = calling
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return seconds, K, sampled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latencies-ms", default="50,200,500", help="tool latencies to measure (comma-separated)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {WORKLOADS}")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each mode, interleaved; the row is the median run (a shared machine's load moves)")
    add_output_args(parser, "agent_concurrency_cpu")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if set(workloads) - set(WORKLOADS):
        parser.error(f"--workloads: unknown {sorted(set(workloads) - set(WORKLOADS))}; known: {WORKLOADS}")
    tok = printable_tokenizer()
    ToolCallParser("qwen25", [SCHEMA]).parse(CALL)  # SGLang's parser loads once (seconds), outside the timings
    latencies = [int(x) for x in args.latencies_ms.split(",")]
    rows = []
    for workload in workloads:
        turns = sum(calls_per_trajectory(workload)) / K + 1
        for ms in latencies:
            modes = (("lockstep", lambda: lockstep(tok, ms / 1000, workload)),
                     ("concurrent", lambda: concurrent(tok, ms / 1000, workload)),
                     ("concurrent_over_sample", lambda: concurrent(tok, ms / 1000, workload, OVER_SAMPLE_RATE)))
            runs: dict[str, list] = {mode: [] for mode, _ in modes}
            for _ in range(args.repeats):
                for mode, fn in modes:
                    runs[mode].append(fn())
            for mode, _ in modes:
                seconds, kept, tokens = sorted(runs[mode])[len(runs[mode]) // 2]  # the median run
                rows.append({"workload": workload, "tool_latency_ms": ms, "mode": mode, "trajectories": K,
                             "kept": kept, "turns_mean": round(turns, 3),
                             "seconds": round(seconds, 3), "trajectories_per_s": round(kept / seconds, 2),
                             "sampled_tokens_per_s": round(tokens / seconds, 1), "repeats": args.repeats,
                             "seconds_min": round(min(r[0] for r in runs[mode]), 3),
                             "seconds_max": round(max(r[0] for r in runs[mode]), 3)})
                print(rows[-1], flush=True)
    for workload in workloads:
        for ms in latencies:
            by = {r["mode"]: r for r in rows if r["tool_latency_ms"] == ms and r["workload"] == workload}
            base = by["lockstep"]["trajectories_per_s"]
            print(f"{workload}, tool latency {ms} ms: concurrent / lockstep = "
                  f"{by['concurrent']['trajectories_per_s'] / base:.2f}x, with over_sample_rate={OVER_SAMPLE_RATE} = "
                  f"{by['concurrent_over_sample']['trajectories_per_s'] / base:.2f}x "
                  f"(batch time {by['lockstep']['seconds'] / by['concurrent_over_sample']['seconds']:.2f}x shorter)")
    out = output_path(args, "agent_concurrency_cpu")
    with open(out + ".json", "w") as f:
        json.dump({"trajectories": K, "max_concurrent": CAP,
                   "workloads": {"uniform": f"{TURNS - 1} calls each, latency uniform [0.5, 1.5] x L",
                                 "agentic": f"1-{MAX_CALLS} calls per trajectory (uniform), latency log-normal with "
                                            f"mean L, sigma {SIGMA}"},
                   "engine": f"simulated continuous batching: {STEP_MS} ms + {PER_REQUEST_MS} ms per running request "
                             "per decode step", "over_sample_rate": OVER_SAMPLE_RATE,
                   "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}.csv and .json")


if __name__ == "__main__":
    main()
