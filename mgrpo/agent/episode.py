"""One trajectory's run as a record and the states it passes through (the runner's state machine).

    GENERATE --> PARSE --+--> CALL_TOOLS --+--> APPEND --> GENERATE (the next turn)
                         +--> ENV_STEP ----+
    any state --> FINISH (its reason on the trajectory; release tools, close the environment)

`AgentTask` is what a trajectory starts from (a prompt of the batch); `Episode` is everything one attempt of it
holds while it runs (its tools, parser, constraints, environment, the turn in hand). A retry is a new Episode
over a restarted trajectory (`Trajectory.restarted`), never a reset of this one's fields.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Optional

from mgrpo.agent.environment import EnvironmentSession
from mgrpo.agent.parse import ParsedTurn, ToolCallParser
from mgrpo.agent.trajectory import Trajectory, Turn
from mgrpo.rollout.types import GenerateResult, SamplingParams


class State(enum.Enum):
    GENERATE = "generate"
    PARSE = "parse"
    CALL_TOOLS = "call_tools"
    ENV_STEP = "env_step"
    APPEND = "append"
    FINISH = "finish"


@dataclass
class AgentTask:
    """One trajectory's input: the prompt's ids, its record's extra_info, where the record is (file:line, for
    errors) and the prompt's messages (what an environment that reads the conversation is given first)."""

    prompt_ids: list[int]
    extra_info: dict = field(default_factory=dict)
    where: str = ""
    messages: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.prompt_ids = list(self.prompt_ids)
        self.extra_info = self.extra_info or {}
        self.messages = list(self.messages or [])

    @classmethod
    def of(cls, prompt) -> "AgentTask":
        """An AgentTask as it is, or one from a (prompt ids, extra_info, where[, messages]) tuple."""
        return prompt if isinstance(prompt, cls) else cls(*prompt)


@dataclass
class Batch:
    """What the trajectories of one `run` share: the dispatcher's queue, the sampling, what was measured."""

    sampling: SamplingParams
    key: str
    """Sessions are unique to this batch's trajectories."""
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    measured: dict = field(default_factory=dict)
    in_flight: set = field(default_factory=set)


@dataclass
class Request:
    """One turn's generation request, as the dispatcher batches it."""

    ids: list[int]
    max_new: int
    future: asyncio.Future
    structural_tag: Optional[str] = None
    stop: tuple[str, ...] = ()
    session: str = ""
    seed: Optional[int] = None
    routes_from: int = 0


@dataclass
class Episode:
    """One attempt of one trajectory, from its first state to FINISH."""

    task: AgentTask
    traj: Trajectory
    batch: Batch
    session: str
    """Its key for the rollout group (its turns go to one engine, for the prefix cache)."""
    names: list[str]
    """The tools its record may call."""
    parser: ToolCallParser
    tags: dict[str, Optional[str]]
    """tool_choice -> the structural tag its requests carry (None: unconstrained)."""
    first: str
    """The first turn's tool_choice (required for a forced trajectory)."""
    env: Optional[EnvironmentSession] = None
    instances: dict[str, str] = field(default_factory=dict)
    """Tool name -> the instance `create` made for this trajectory (released at FINISH)."""
    versions: list[int] = field(default_factory=list)
    called: bool = False
    user_turns: int = 0
    turn: int = 0
    # the turn in hand
    tag: Optional[str] = None
    result: Optional[GenerateResult] = None
    text: str = ""
    current: Optional[Turn] = None
    parsed: Optional[ParsedTurn] = None
    context: list[dict] = field(default_factory=list)
    """The messages that continue the conversation after this turn (tool replies or the environment's)."""
    role: str = "tool"
    context_t0: float = 0.0

    @property
    def kwargs(self) -> dict:
        """extra_info.tools_kwargs: per tool, create_kwargs / execute_kwargs / calc_reward_kwargs."""
        return self.task.extra_info.get("tools_kwargs") or {}

    def end(self, reason: str) -> State:
        self.traj.finish_reason = reason
        return State.FINISH
