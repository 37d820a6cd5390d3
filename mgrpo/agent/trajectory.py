"""One multi-turn trajectory as the trainer needs it: token ids after the prompt, which of them the policy
sampled (mask 1: loss and behaviour log-prob) and which are context (tool replies, template tokens: mask 0,
log-prob 0.0, never in a loss or a metric), plus its turns for the trajectory lines."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

log = logging.getLogger("mgrpo")

FINISH_REASONS = ("stop", "length", "max_turns", "tool_timeout", "trajectory_timeout", "generation_error",
                  "env_failed", "aborted")
"""How a trajectory ends. stop: an assistant turn without tool calls ended on EOS; length: the response
budget (data.max_response_length) is used up; max_turns: rollout.multi_turn.max_assistant_turns reached.
The rest are failures (`FAILED`); aborted: cut as the step's long tail (rollout.over_sample_rate). A failed
trajectory stays in its place in the batch and goes through the one failed-sample path: its finish reason
is its outcome (`Experience.mark_failed`), so it has no reward, leaves the loss and its group's baseline, and
is counted with every other failure (mgrpo/rewards/failed.py); never a made-up reward."""

FAILED = ("tool_timeout", "trajectory_timeout", "generation_error", "env_failed", "aborted")

RETRIED = ("tool_timeout", "env_failed")
"""The transient faults of a tool or an environment (user code): with rollout.multi_turn.trajectory_retries the
trajectory is generated again from its prompt with the same seeds, and ends failed only when retries run out.
Not retried here: trajectory_timeout (the wall-clock bound covers every attempt), generation_error (the rollout
group retried the call already) and aborted (the long-tail cut)."""

FAULT_COUNTS = ("multi_turn/tool_timeouts", "multi_turn/env_timeouts", "multi_turn/env_errors",
                "multi_turn/trajectory_retries")
"""What a failed attempt counted that stays counted when its trajectory is generated again (the faults
themselves and the retries); the rest of its counts (turns, calls) belong to the attempt that was dropped."""


@dataclass
class Turn:
    role: str
    """'assistant' (sampled) or 'tool' (context: the replies plus the template's next generation prompt)."""
    start: int
    end: int
    """Token span [start, end) in the response."""
    text: str = ""
    calls: list[dict] = field(default_factory=list)
    """Assistant turns: the parsed calls, {"name", "arguments"} (arguments None when they did not parse)."""
    errors: list[str] = field(default_factory=list)
    latency_s: float = 0.0
    """Generation (assistant) or tool execution (tool) seconds."""


@dataclass
class Trajectory:
    uid: int
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    """1 where the policy sampled the token, 0 for context."""
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = ""
    weight_version: Optional[int] = None
    """The oldest weights that sampled a turn of it; one that never generated (failed or cut before its first
    turn) takes its batch's (AgentRunner.run), so the staleness bound never drops it for a version it lacks."""
    engine: object = None
    tool_reward: float = 0.0
    masked: bool = False
    """A tool-call error happened and rollout.multi_turn.on_tool_error=mask: kept out of the loss."""
    called: bool = False
    """An assistant turn of it wrote a tool call (well-formed or not): the runner's `called`."""
    forced: bool = False
    """Its first turn was under tool_choice=required (rollout.multi_turn.required_per_group): the call is the
    grammar's, not the policy's choice."""
    counts: dict = field(default_factory=dict)
    """What this trajectory counted (tool calls, errors per tool, parse errors, truncations)."""
    messages: list[dict] = field(default_factory=list)
    """The conversation after the prompt as OpenAI messages (assistant content and parsed tool_calls, tool
    replies): what the drift check renders."""
    supports: list = field(default_factory=list)
    """Per response token, the engine's sampling support (algorithm.logprob_support=sampled: the ids the token
    was sampled from) or None (the whole vocabulary; every context token)."""
    supports_missing: bool = False
    """Supports were asked for and an engine answered a turn without them (Experience refuses the sample)."""
    routes: Optional[np.ndarray] = None
    """actor.router_replay=rollout: the engine's routed experts of positions [0, len(routes)) of prompt +
    response, each from the turn that first computed it (mgrpo/agent/turn_routes.py); None before the first turn."""
    routes_missing: bool = False
    """Routes were asked for and an engine answered a turn without them (Experience refuses the batch)."""

    @property
    def failed(self) -> bool:
        return self.finish_reason in FAILED

    def add(self, ids: list[int], logprobs: Optional[list[float]], role: str,
            sampled: Optional[list[int]] = None, support: Optional[list] = None, **turn) -> Turn:
        """`sampled`: per token 1/0 within a sampled turn (0: a token a grammar chose, context with log-prob
        0.0); by default every token of a turn with log-probs is sampled, of one without none. `support`: the
        engine's per-token sampling supports of a sampled turn (kept for the sampled tokens only)."""
        start = len(self.response_ids)
        if sampled is None:
            sampled = [1 if logprobs is not None else 0] * len(ids)
        if len(sampled) != len(ids):
            raise ValueError(f"{len(sampled)} sampled flags for {len(ids)} tokens")
        self.response_ids.extend(ids)
        self.sampled.extend(sampled)
        lps = logprobs if logprobs is not None else [0.0] * len(ids)
        self.logprobs.extend(lp if s else 0.0 for lp, s in zip(lps, sampled))
        rows = support if support is not None else [None] * len(ids)
        if len(rows) != len(ids):
            raise ValueError(f"{len(rows)} sampling supports for {len(ids)} tokens")
        self.supports.extend(row if s else None for row, s in zip(rows, sampled))
        t = Turn(role=role, start=start, end=len(self.response_ids), **turn)
        self.turns.append(t)
        return t

    def restarted(self) -> "Trajectory":
        """A new attempt of this trajectory from its prompt (a retry): the same uid, prompt and forcing, no turns,
        the faults counted so far kept and the retry counted, by the reason this attempt ended."""
        fresh = Trajectory(uid=self.uid, prompt_ids=self.prompt_ids, forced=self.forced)
        fresh.counts = {k: v for k, v in self.counts.items() if k.startswith(FAULT_COUNTS)}
        fresh.count("multi_turn/trajectory_retries")
        fresh.count(f"multi_turn/trajectory_retries/{self.finish_reason}")
        return fresh

    def count(self, key: str, n: int = 1) -> None:
        self.counts[key] = self.counts.get(key, 0) + n

    def last_assistant_text(self) -> str:
        return next((t.text for t in reversed(self.turns) if t.role == "assistant"), "")

    def to_json(self) -> dict:
        """Turns for a trajectory line."""
        return {"finish_reason": self.finish_reason, "tool_reward": self.tool_reward, "masked": self.masked,
                "forced": self.forced, "called": self.called,
                "turns": [{"role": t.role, "span": [t.start, t.end], "text": t.text, "calls": t.calls,
                           "errors": t.errors, "latency_s": round(t.latency_s, 4)} for t in self.turns]}


def batch_metrics(trajs: Sequence[Trajectory], measured: dict, free_choice: bool = False) -> dict:
    """A batch's multi_turn/ metrics: `measured` (the dispatcher's) plus the trajectories' counts and rates.
    `free_choice`: tool_choice=auto, the unforced trajectories' calls are the policy's (free_call_rate)."""
    n = max(len(trajs), 1)
    out = dict(measured)
    for t in trajs:
        for k, v in t.counts.items():
            if k.startswith("multi_turn/"):
                out[k] = out.get(k, 0) + v
        out[f"multi_turn/finish/{t.finish_reason}"] = out.get(f"multi_turn/finish/{t.finish_reason}", 0) + 1
    out["multi_turn/turns_mean"] = sum(t.counts.get("turns", 0) for t in trajs) / n
    out["multi_turn/tool_calls_per_trajectory"] = sum(t.counts.get("multi_turn/tool_calls", 0) for t in trajs) / n
    out["multi_turn/forced_trajectories"] = sum(t.forced for t in trajs)  # rollout.multi_turn.required_per_group
    if free_choice:  # the policy's own choice to call: trajectories whose first turn was under auto
        free = [t for t in trajs if not t.forced]
        out["multi_turn/free_trajectories"] = len(free)
        out["multi_turn/free_calling_trajectories"] = sum(t.called for t in free)
        out["multi_turn/free_call_rate"] = sum(t.called for t in free) / max(len(free), 1)
    out["multi_turn/failed"] = sum(t.failed for t in trajs)
    out["multi_turn/masked"] = sum(t.masked for t in trajs)
    out["multi_turn/context_tokens"] = sum(len(t.sampled) - sum(t.sampled) for t in trajs)
    return out


MOSTLY_INVALID = 0.5
"""A batch in which more than this share of the calls the model wrote could not run (bad arguments, malformed,
unknown tool) is warned about and counted (multi_turn/mostly_invalid_batches)."""


def warn_invalid_calls(metrics: dict) -> None:
    """Say so (and count it) when most calls the model wrote in this batch could not run: a schema the model
    cannot follow (e.g. a function tool that is not `strict` under tool_choice=required) is otherwise silent."""
    invalid = sum(metrics.get(f"multi_turn/{k}", 0) for k in ("bad_arguments", "parse_errors", "unknown_tool"))
    written = metrics.get("multi_turn/calls_written", 0)
    metrics["multi_turn/invalid_calls"] = invalid
    metrics["multi_turn/invalid_call_rate"] = invalid / written if written else 0.0
    metrics["multi_turn/mostly_invalid_batches"] = int(written > 0 and invalid > MOSTLY_INVALID * written)
    if metrics["multi_turn/mostly_invalid_batches"]:
        log.warning("%d of the %d tool calls the model wrote in this batch could not run (bad arguments %d, "
                    "malformed %d, unknown tool %d): is each tool's schema one the model can follow? (a call's "
                    "arguments follow the schema only when the tool is strict: rollout.multi_turn."
                    "strict_function_tools for function tools, `strict: true` in a tool-config YAML's function)",
                    invalid, written, metrics.get("multi_turn/bad_arguments", 0),
                    metrics.get("multi_turn/parse_errors", 0), metrics.get("multi_turn/unknown_tool", 0))
