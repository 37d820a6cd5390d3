"""veRL's own tools and interactions by the class names veRL's configs write (`verl.tools.gsm8k_tool.Gsm8kTool`,
`verl.interactions.gsm8k_interaction.Gsm8kInteraction`): a veRL tool or interaction config runs as written,
without veRL installed. mgrpo/agent/tools.py::load_verl_tool_config and mgrpo/agent/interaction.py load the
class named here instead of importing veRL.

Each class keeps veRL's behaviour and replies to the character (the model was prompted with veRL's examples),
with veRL's lifecycle (tools: create / execute / calc_reward / release; interactions: start_interaction /
generate_response / calculate_score / finalize_interaction), duck-typed like any user class."""

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


class Gsm8kInteraction:
    """verl/interactions/gsm8k_interaction.py: after each assistant turn without a tool call, the last
    assistant message is judged with veRL's GSM8K judge (strict: '#### <answer>'); correct -> "Your response is
    correct!" and the episode ends, otherwise "Your response is incorrect! You need to reflect on your answer
    and try again." as the user's next message. Its turn score is the judge's (0.0 or 1.0)."""

    def __init__(self, config: dict):
        self.config = config
        self.name = config.get("name", "interaction_agent")
        self._instances: dict[str, dict] = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        content = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = content
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k.compute_score("openai/gsm8k", state["response"] or "", state["ground_truth"], method="strict",
                                   format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


BUILTIN_INTERACTIONS = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": Gsm8kInteraction}
"""veRL's interaction class name -> the class that runs in its place."""
