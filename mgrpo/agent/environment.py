"""Environments: interaction that is not a tool call (games, user simulators, multi-step tasks).

A class given by import path (`rollout.multi_turn.environment=module:Class`), built once per trajectory with
no arguments. `reset(extra_info)` starts it from the record; after every assistant turn that calls no tool,
`step(text)` (the turn's text) returns an `EnvStep`: the messages that continue the conversation (rendered by
the chat template as context tokens, e.g. `{"role": "user", "content": ...}`), an optional reward (added to
the sample's score) and whether the episode is done. An environment that reads the whole conversation says so
with `wants_messages = True` and is stepped as `step(text, messages)` (veRL's interactions); `close()`, when it
has one, runs when its trajectory ends. Every method may be sync or async and runs under
rollout.multi_turn.tool_timeout_s; an environment that raises or hangs ends its trajectory as `env_failed` /
`tool_timeout`: failed, dropped from the loss and its group's baseline, counted.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from mgrpo.agent.threads import run_sync
from mgrpo.config import ConfigError


@dataclass
class EnvStep:
    messages: list[dict] = field(default_factory=list)
    reward: Optional[float] = None
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    """What the runner calls (sync or async; subclassing is optional: any class with these methods is one)."""

    def reset(self, extra_info: dict) -> Any:
        ...

    def step(self, text: str) -> Any:
        """-> EnvStep (or an awaitable of one); `step(text, messages)` when the class sets wants_messages."""
        ...


@runtime_checkable
class Closable(Protocol):
    def close(self) -> Any:
        ...


async def call_maybe_sync(method: Callable, *args, **kwargs) -> Any:
    """An async method awaited, a sync one in a daemon thread (a slow one holds only its own trajectory, a hung
    one never holds the process: mgrpo/agent/threads.py)."""
    if inspect.iscoroutinefunction(method):
        return await method(*args, **kwargs)
    return await run_sync(method, *args, **kwargs)


class EnvironmentSession:
    """One trajectory's environment: the user's object behind the three calls the runner makes, each the same
    whatever the class spells (sync or async, with or without the conversation, with or without close)."""

    def __init__(self, env: Environment):
        if not isinstance(env, Environment):
            raise ConfigError(f"rollout.multi_turn.environment: {type(env).__name__} has no reset(extra_info) and "
                              "step(text) methods (mgrpo/agent/environment.py)")
        self.env = env
        self.wants_messages = getattr(type(env), "wants_messages", False) is True

    async def reset(self, extra_info: dict) -> None:
        await call_maybe_sync(self.env.reset, extra_info)

    async def step(self, text: str, conversation: list[dict]) -> EnvStep:
        args = (text, conversation) if self.wants_messages else (text,)
        return await call_maybe_sync(self.env.step, *args)

    async def close(self) -> None:
        if isinstance(self.env, Closable):
            await call_maybe_sync(self.env.close)
