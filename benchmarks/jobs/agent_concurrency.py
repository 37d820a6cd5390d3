"""Per-trajectory concurrency against turn-lockstep batching for multi-turn tool rollouts.

    python -m benchmarks.jobs.agent_concurrency       # -> benchmarks/results/agent_concurrency_cpu.{csv,json}

64 trajectories of 4 assistant turns (3 tool calls, then the answer) on the printable tokenizer's Qwen3-style
template. The tool sleeps a latency drawn per call from [0.5, 1.5] x L (L = 50, 200, 500 ms). The engine is
simulated (a generate call costs 30 ms + 2 ms per request in the batch, as batched decoding on a busy server
roughly does), so what is measured is the scheduling, nothing else:
  - concurrent: mgrpo's AgentRunner (each trajectory its own coroutine; ready turns go out together);
  - lockstep: every turn, one generate for all live trajectories, then all their tool calls, and the next turn
    waits for the slowest call (TRL's GRPO trainer's multi-turn loop works this way).
Both use the same parser, template and tool code; the numbers are trajectories/s and sampled tokens/s.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import random
import time

from mgrpo.agent.parse import ToolCallParser
from mgrpo.agent.runner import AgentRunner
from mgrpo.agent.template import ChatTemplate
from mgrpo.agent.tools import BaseTool, ToolSet
from mgrpo.config.schema import MultiTurnConfig
from mgrpo.data.printable import printable_tokenizer
from mgrpo.rollout.types import GenerateResult, SamplingParams

K, TURNS = 64, 4
SCHEMA = {"type": "function", "function": {"name": "lookup", "description": "Slow lookup.",
                                           "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "lookup", "arguments": {}}\n</tool_call>'


class SlowTool(BaseTool):
    def __init__(self, latency_s: float, seed: int):
        super().__init__({}, SCHEMA)
        self.latency_s, self.rng = latency_s, random.Random(seed)

    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(self.latency_s * self.rng.uniform(0.5, 1.5))
        return "42", None, {}


class SimulatedEngine:
    def __init__(self, tok, prompt_lens: dict):
        self.tok, self.calls = tok, 0
        self.call_ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        self.answer_ids = tok("It is 42.", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def __call__(self, prompts, sampling):
        time.sleep(0.030 + 0.002 * len(prompts))
        self.calls += 1
        out = []
        for ids in prompts:
            # assistant turns so far: the prompt ends 2 turns (system, user) with <|im_end|>, each tool round 2 more
            turns = (ids.count(self.tok.eos_token_id) - 2) // 2
            new = self.call_ids if turns < TURNS - 1 else self.answer_ids
            out.append(GenerateResult(uid=0, token_ids=list(new), logprobs=[-0.1] * len(new), finish_reason="stop",
                                      weight_version=0))
        return out, {}


def _prompts(tok):
    return [tok(tok.apply_chat_template([{"role": "user", "content": f"q{i}"}], tools=[SCHEMA], tokenize=False,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for i in range(K)]


def concurrent(tok, latency_s: float) -> tuple[float, int]:
    cfg = MultiTurnConfig(enable=True, max_assistant_turns=TURNS, function_tools=["x:y"])
    runner = AgentRunner(cfg, tok, ToolSet([SlowTool(latency_s, 0)]), max_response_length=4096)
    prompts = _prompts(tok)
    t0 = time.perf_counter()
    trajs, _ = runner.run([(p, {}, "") for p in prompts], SamplingParams(max_new_tokens=4096),
                          SimulatedEngine(tok, {}))
    assert all(t.finish_reason == "stop" and len(t.turns) == 2 * TURNS - 1 for t in trajs)
    return time.perf_counter() - t0, sum(sum(t.sampled) for t in trajs)


def lockstep(tok, latency_s: float) -> tuple[float, int]:
    tool, template, engine = SlowTool(latency_s, 0), ChatTemplate(tok), SimulatedEngine(tok, {})
    parser = ToolCallParser("qwen25", [SCHEMA])
    ids = _prompts(tok)
    sampled = 0
    t0 = time.perf_counter()
    live = list(range(K))
    for _ in range(TURNS):
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
    return time.perf_counter() - t0, sampled


def main() -> None:
    tok = printable_tokenizer()
    ToolCallParser("qwen25", [SCHEMA]).parse(CALL)  # SGLang's parser loads once (seconds), outside the timings
    rows = []
    for ms in (50, 200, 500):
        for mode, fn in (("concurrent", concurrent), ("lockstep", lockstep)):
            seconds, tokens = fn(tok, ms / 1000)
            rows.append({"tool_latency_ms": ms, "mode": mode, "trajectories": K, "turns": TURNS,
                         "seconds": round(seconds, 3), "trajectories_per_s": round(K / seconds, 2),
                         "sampled_tokens_per_s": round(tokens / seconds, 1)})
            print(rows[-1], flush=True)
    for ms in (50, 200, 500):
        c, lk = (next(r for r in rows if r["tool_latency_ms"] == ms and r["mode"] == m) for m in ("concurrent", "lockstep"))
        print(f"tool latency {ms} ms: concurrent / lockstep = {c['trajectories_per_s'] / lk['trajectories_per_s']:.2f}x")
    out = os.path.join(os.path.dirname(__file__), "..", "results", "agent_concurrency_cpu")
    with open(out + ".json", "w") as f:
        json.dump({"engine": "simulated: 30 ms + 2 ms per request per generate call", "rows": rows}, f, indent=1)
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
