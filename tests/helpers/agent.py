"""A scripted 'policy' for the multi-turn agent tests: a generate callable that answers each trajectory's next
turn from a script (the text a model would sample), so token-level exactness, bounds and concurrency are
checked without a model. Every trajectory needs a prompt of its own (the request's prefix tells them apart)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

from mgrpo.rollout.types import GenerateResult


class ScriptedPolicy:
    """generate(prompts, sampling): request -> the trajectory whose prompt prefixes it -> `script(uid, turn)`,
    encoded, EOS appended (cut at sampling.max_new_tokens: finish 'length'); with sampling.stop, cut after the
    first stop string it holds, kept, and no EOS (SGLang's rule). `delay_s`: seconds per call.
    Keeps what it 'sampled' per trajectory and when each call came, with which trajectories."""

    def __init__(self, tok, script: Callable[[int, int], str], prompts: list[list[int]], delay_s: float = 0.0):
        self.tok, self.script, self.delay_s = tok, script, delay_s
        self.prompts = [list(p) for p in prompts]
        self.sampled: dict[int, list[list[int]]] = {}
        self.calls: list[tuple[float, list[int]]] = []

    def uid_of(self, ids: list[int]) -> int:
        hits = [u for u, p in enumerate(self.prompts) if ids[:len(p)] == p]
        assert len(hits) == 1, f"a request that continues {len(hits)} trajectories"
        return hits[0]

    def __call__(self, prompts: list[list[int]], sampling, sessions=None, seeds=None):
        if self.delay_s:
            time.sleep(self.delay_s)
        out, uids = [], []
        for ids in prompts:
            uid = self.uid_of(ids)
            uids.append(uid)
            turn = len(self.sampled.get(uid, []))
            text = self.script(uid, turn)
            hits = [text.index(x) + len(x) for x in getattr(sampling, "stop", ()) if x in text]
            end = [] if hits else [self.tok.eos_token_id]
            new = self.tok(text[:min(hits)] if hits else text, add_special_tokens=False)["input_ids"] + end
            finish = "stop"
            if len(new) > sampling.max_new_tokens:
                new, finish = new[:sampling.max_new_tokens], "length"
            self.sampled.setdefault(uid, []).append(new)
            out.append(GenerateResult(uid=0, token_ids=new, logprobs=[-0.25] * len(new), finish_reason=finish,
                                      weight_version=3))
        self.calls.append((time.monotonic(), uids))
        return out, {"rollout/retries": 0}


class AlwaysReply:
    """An environment (rollout.multi_turn.environment) that answers every assistant turn with a user message:
    every trajectory whose first turn ends on EOS gets a context span and a next turn, whatever the model."""

    def reset(self, extra_info):
        self.n = 0

    def step(self, text):
        from mgrpo.agent.environment import EnvStep

        self.n += 1
        return EnvStep(messages=[{"role": "user", "content": f"again {self.n}"}])


class SlowEveryFourth(AlwaysReply):
    """AlwaysReply whose every fourth episode (in the order the process builds them) takes 3 s to start: in a batch
    of 4k trajectories those k are the long tail that rollout.over_sample_rate=0.25 cuts, whatever the model does."""

    built = 0

    def __init__(self):
        SlowEveryFourth.built += 1
        self.slow = SlowEveryFourth.built % 4 == 0

    async def reset(self, extra_info):
        import asyncio

        self.n = 0
        if self.slow:
            await asyncio.sleep(3.0)


def add(a: int, b: int = 0) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def slow_tool(seconds: float):
    """A tool `slow(x)` that sleeps `seconds` before it answers "1" (the trajectory that calls it waits)."""
    async def slow(x: int) -> str:
        """Slow.

        Args:
            x: a number
        """
        await asyncio.sleep(seconds)
        return "1"

    return slow


def tool_prompts(tok, tools, k: int) -> list[list[int]]:
    schemas = tools.schemas(list(tools.tools))
    return [tok(tok.apply_chat_template([{"role": "user", "content": f"question {i}"}], tools=schemas, tokenize=False,
                                        add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            for i in range(k)]


def call_text(name: str, args: dict, compact: bool = False) -> str:
    body = json.dumps({"name": name, "arguments": args}, separators=(",", ":") if compact else None,
                      ensure_ascii=False)  # as the template's tojson
    return f"<tool_call>\n{body}\n</tool_call>"
