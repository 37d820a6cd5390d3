"""veRL's own tools, by the class names veRL's tool configs write (`class_name: verl.tools.gsm8k_tool.Gsm8kTool`):
a veRL tool config runs as written, without veRL installed. `rollout.multi_turn.tool_config_path` loads the
class named here instead of importing veRL (mgrpo/agent/tools.py::load_verl_tool_config).

Each class keeps veRL's behaviour and replies to the character (the model was prompted with veRL's examples),
with veRL's lifecycle (create / execute / calc_reward / release; duck-typed like any user tool)."""

from __future__ import annotations

import uuid
from typing import Any, Optional

from mgrpo.rewards import gsm8k


class Gsm8kTool:
    """verl/tools/gsm8k_tool.py: `calc_gsm8k_reward(answer)` scores the answer with veRL's GSM8K judge
    (flexible extraction, 1.0 or 0.0), replies "Current parsed answer='...' reward=...", and gives a step
    reward of -0.05 for a submission that does not improve on the trajectory's best so far (0.0 otherwise).
    The ground truth comes from the record: `extra_info.tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth`
    (veRL's examples/data_preprocess/gsm8k_multiturn_w_tool.py writes it there)."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config, self.tool_schema = config, tool_schema
        self._instances: dict[str, dict] = {}

    def get_openai_tool_schema(self) -> dict:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None, **kwargs) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:  # veRL's agent loop passes create_kwargs={...} as one argument
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        answer = parameters.get("answer", "")
        if not isinstance(answer, str):
            answer = str(answer)
        state = self._instances[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05  # veRL: a submission that does not improve
        state["reward"] = reward
        return f"Current parsed {answer=} {reward=}", step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k.compute_score("openai/gsm8k", state["response"], state["ground_truth"], method="flexible",
                                   format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


BUILTIN_TOOLS = {"verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kTool}
"""veRL's class name -> the class that runs in its place."""
