"""A trajectory's tool calls: each run under rollout.multi_turn.tool_timeout_s (several of one turn concurrently,
at most max_parallel_calls), veRL's lifecycle per tool instance (create once per trajectory, execute per call,
calc_reward and release at its end), replies truncated as veRL does. A call that cannot run (malformed, unknown
tool, bad arguments, the tool raised) gets an error as its reply: the model sees it, the run counts it per tool
(with on_tool_error=mask the trajectory is also kept out of the loss). A hang raises ToolTimeout: the
trajectory fails (tool_timeout)."""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import time
import uuid
from typing import Optional

from mgrpo.agent.tools import BadArguments, ToolResult, ToolSet, as_text
from mgrpo.agent.trajectory import Trajectory
from mgrpo.config.schema import MultiTurnConfig


def create(tool, create_kwargs: dict):
    """A tool instance for one trajectory, called so that a class written for either of veRL's rollouts gets its
    record's values and a unique id: an instance id (veRL's SGLang rollout passed its request id; a tool that
    does not make one itself still gets its own), the record's create_kwargs as keywords (that rollout's
    call), and, when the method takes **kwargs, also as `create_kwargs=` (veRL's agent loop's call, which
    tools written for it read from kwargs)."""
    params = inspect.signature(tool.create).parameters
    extra = {"create_kwargs": create_kwargs} if "create_kwargs" not in create_kwargs and (
        "create_kwargs" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())) else {}
    return tool.create(str(uuid.uuid4()), **create_kwargs, **extra)


class ToolTimeout(Exception):
    """A tool (or an environment) ran past rollout.multi_turn.tool_timeout_s: its trajectory fails."""


def truncate(text: str, limit: int, side: str) -> tuple[str, bool]:
    """veRL's tool-reply truncation (ToolAgentLoop): keep `limit` characters and mark the cut."""
    if len(text) <= limit:
        return text, False
    if side == "left":
        return text[:limit] + "...(truncated)", True
    if side == "right":
        return "(truncated)..." + text[-limit:], True
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:], True


class ToolCalls:
    def __init__(self, cfg: MultiTurnConfig, tools: ToolSet):
        self.cfg, self.tools = cfg, tools

    async def run(self, traj: Trajectory, parsed, names: list[str], kwargs: dict,
                         instances: dict) -> list[str]:
        calls = list(parsed.calls)
        traj.count("multi_turn/calls_written", len(calls) + parsed.malformed)
        replies: list[Optional[str]] = [None] * len(calls)
        jobs = []
        for i, c in enumerate(calls):
            if c.error is not None or c.name not in names:
                why = c.error or f"tool {c.name!r} is not available for this task"
                replies[i] = self.error(traj, c.name if c.known and c.name in names else None, why,
                                         "unknown_tool" if not c.known or c.name not in names else "bad_arguments")
            elif i >= self.cfg.max_parallel_calls:
                replies[i] = self.error(traj, c.name, f"more than {self.cfg.max_parallel_calls} calls in one turn",
                                         "too_many_calls")
            else:
                jobs.append(i)
        results = await asyncio.gather(*(self.call(traj, calls[i].name, calls[i].arguments, kwargs, instances)
                                         for i in jobs))
        for i, r in zip(jobs, results):
            replies[i] = r
        for _ in range(parsed.malformed):
            replies.append(self.error(traj, None, "the tool call could not be parsed (expected "
                                                   '{"name": ..., "arguments": {...}} inside the call tags)',
                                       "parse_errors"))
        return [r for r in replies if r is not None]

    def error(self, traj: Trajectory, tool: Optional[str], why: str, kind: str) -> str:
        """A call that could not run: the error is its reply (the model sees it), counted (`fault`)."""
        self.fault(traj, tool, why, kind)
        return f"Error: {why}"

    def fault(self, traj: Trajectory, tool: Optional[str], why: str, kind: str) -> None:
        """A tool error, counted as `kind`, per tool and in total, named in the turn's errors."""
        traj.count(f"multi_turn/{kind}")
        traj.count("multi_turn/tool_errors")
        if tool:
            traj.count(f"multi_turn/tool_errors/{tool}")
        if self.cfg.on_tool_error == "mask":
            traj.masked = True
        traj.turns[-1].errors.append(why)

    async def call(self, traj: Trajectory, name: str, args: dict, kwargs: dict, instances: dict) -> str:
        tool = self.tools.tools[name]
        per = kwargs.get(name) or {}
        t0 = time.perf_counter()
        traj.count("multi_turn/tool_calls")
        traj.count(f"multi_turn/tool_calls/{name}")
        try:
            if name not in instances:
                made = await asyncio.wait_for(create(tool, per.get("create_kwargs") or {}), self.cfg.tool_timeout_s)
                instances[name] = made[0] if isinstance(made, tuple) else made  # newer veRL: (id, response)
            out = await asyncio.wait_for(tool.execute(instances[name], args, **(per.get("execute_kwargs") or {})),
                                         self.cfg.tool_timeout_s)
        except asyncio.TimeoutError:
            traj.count("multi_turn/tool_timeouts")
            traj.count(f"multi_turn/tool_timeouts/{name}")
            raise ToolTimeout(name) from None
        except BadArguments as err:
            return self.error(traj, name, f"bad arguments for {name}: {err}", "bad_arguments")
        except Exception as err:  # noqa: BLE001 - the tool's failure is its reply, counted
            return self.error(traj, name, f"{name} raised {type(err).__name__}: {err}", "tool_raised")
        finally:
            traj.count(f"multi_turn/tool_seconds/{name}", time.perf_counter() - t0)
        try:  # what it returned: a reply whose str() raises is the tool's fault too, never the run's
            result = ToolResult(as_text(out[0]), out[1] if len(out) > 1 else None) if isinstance(out, tuple) \
                else ToolResult(as_text(out))
        except Exception as err:  # noqa: BLE001 - counted, the error is its reply
            return self.error(traj, name, f"{name}'s reply cannot be read as text ({type(err).__name__}: {err})",
                              "bad_replies")
        self.add_reward(traj, name, result.reward, "step reward")
        text, cut = truncate(result.text, self.cfg.max_tool_response_length, self.cfg.tool_response_truncate_side)
        if cut:
            traj.count("multi_turn/tool_response_truncated")
        return text

    def add_reward(self, traj: Trajectory, name: str, value, what: str) -> None:
        """A tool's reward into the trajectory's tool reward; one that is not a finite number is the tool's
        fault (counted as a tool error, multi_turn/bad_tool_rewards), never a score."""
        if value is None:
            return
        reward, why = step_reward(value)
        if why:
            self.fault(traj, name, f"{name}'s {what} {why}", "bad_tool_rewards")
            return
        traj.tool_reward += reward

    async def release(self, traj: Trajectory, instances: dict, kwargs: dict) -> None:
        """veRL's end of an instance: calc_reward, then release, each bounded; release runs whatever
        calc_reward did (raised, hung, returned something that is not a number), every fault counted."""
        for name, iid in instances.items():
            tool, per = self.tools.tools[name], kwargs.get(name) or {}
            try:
                reward = await asyncio.wait_for(tool.calc_reward(iid, **(per.get("calc_reward_kwargs") or {})),
                                                self.cfg.tool_timeout_s)
            except Exception as err:  # noqa: BLE001 - counted; the trajectory is already over
                self._release_error(traj, name, "calc_reward", err)
            else:
                self.add_reward(traj, name, reward, "calc_reward")
            try:
                await asyncio.wait_for(tool.release(iid), self.cfg.tool_timeout_s)
            except Exception as err:  # noqa: BLE001 - counted; the trajectory is already over
                self._release_error(traj, name, "release", err)

    @staticmethod
    def _release_error(traj: Trajectory, name: str, what: str, err: BaseException) -> None:
        traj.count("multi_turn/tool_release_errors")
        traj.count(f"multi_turn/tool_release_errors/{name}")
        if traj.turns:
            traj.turns[-1].errors.append(f"{name} {what}: {type(err).__name__}: {err or 'timed out'}")


def step_reward(value) -> tuple[float, str]:
    """(the reward as a float, '') or (0.0, why it is not one): not a number, or NaN / infinite."""
    if isinstance(value, (bool, str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        return 0.0, f"is not a number ({type(value).__name__} {repr(value)[:60]})"
    try:
        reward = float(value)  # numbers, NumPy and torch scalars
    except (TypeError, ValueError) as err:
        return 0.0, f"is not a number ({type(value).__name__}: {err})"
    if not math.isfinite(reward):
        return 0.0, f"is {reward} (not a finite number)"
    return reward, ""
