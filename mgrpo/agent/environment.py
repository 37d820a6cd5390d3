"""Environments: interaction that is not a tool call (games, user simulators, multi-step tasks).

A class given by import path (`rollout.multi_turn.environment=module:Class`), built once per trajectory with
no arguments. `reset(extra_info)` starts it from the record; after every assistant turn that calls no tool,
`step(text)` (the turn's text) returns an `EnvStep`: the messages that continue the conversation (rendered by
the chat template as context tokens, e.g. `{"role": "user", "content": ...}`), an optional reward (added to
the sample's score) and whether the episode is done. Both may be sync or async and run under
rollout.multi_turn.tool_timeout_s; an environment that raises or hangs ends its trajectory as
`env_failed` / `tool_timeout`: failed, dropped from the loss and its group's baseline, counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class EnvStep:
    messages: list[dict] = field(default_factory=list)
    reward: Optional[float] = None
    done: bool = False


class Environment:
    """The interface (subclassing it is optional)."""

    def reset(self, extra_info: dict) -> None:
        pass

    def step(self, text: str) -> EnvStep:
        return EnvStep(done=True)
