"""A user's tool and environment for the multi-turn chaos job, with the faults a user's code really has: the peek
task's tool (veRL's BaseTool, listed in tests/helpers/chaos_tools.yaml, given by import path as users give theirs)
that can hang, and an environment (rollout.multi_turn.environment=tests.helpers.chaos_tools:PeekEnvironment)
whose step can raise.

The chaos harness (tests/helpers/chaos.py) asks for a fault by writing a file named after its kind into the
folder named by $MGRPO_CHAOS_FAULTS (the run's environment): `tool_hang` makes the tool's next call sleep past
rollout.multi_turn.tool_timeout_s (an `await` that never returns, as a network call that hangs), `env_crash`
makes the environment's next step raise. The file holds how many calls it fires for (1 when empty); the call
that takes the last one removes it. Without the variable or the file both behave as the plain peek task: the
tool says its digit, the environment ends the episode after the answer (no messages, no reward), so a run
without faults samples, scores and trains exactly what recipe=tool-peek-tiny-cpu does.
"""

from __future__ import annotations

import asyncio
import os
import threading
from mgrpo.agent.environment import EnvStep
from mgrpo.agent.examples import PeekTool

FAULTS_ENV = "MGRPO_CHAOS_FAULTS"
_lock = threading.Lock()  # environment steps run in worker threads


def take_fault(kind: str) -> bool:
    """Whether a fault of `kind` is asked for now; takes one of its count."""
    folder = os.environ.get(FAULTS_ENV)
    if not folder:
        return False
    path = os.path.join(folder, kind)
    with _lock:
        try:
            with open(path) as f:
                left = int(f.read().strip() or 1)
        except FileNotFoundError:
            return False
        if left <= 1:
            os.remove(path)
        else:
            with open(path, "w") as f:
                f.write(str(left - 1))
    return True


class FaultyPeekTool(PeekTool):
    """The peek tool; a `tool_hang` fault makes a call wait forever (cancelled at tool_timeout_s)."""

    async def execute(self, instance_id: str, parameters: dict, **kwargs):
        if take_fault("tool_hang"):
            await asyncio.Event().wait()  # nobody sets it: the call hangs until the runner's timeout cancels it
        return await super().execute(instance_id, parameters, **kwargs)


class PeekEnvironment:
    """Ends the episode after the answer; an `env_crash` fault makes its step raise."""

    def reset(self, extra_info: dict) -> None:
        self.turns = 0

    def step(self, text: str) -> EnvStep:
        self.turns += 1
        if take_fault("env_crash"):
            raise RuntimeError("chaos: the environment crashed (env_crash)")
        return EnvStep(done=True)

    def close(self) -> None:
        pass
