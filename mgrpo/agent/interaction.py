"""veRL's interactions (`rollout.multi_turn.interaction_config_path`, veRL's BaseInteraction), as an environment.

veRL's interaction config, exactly as veRL writes it:
    interaction:
      - name: gsm8k
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}
Each class is built once, `cls(config)` with the entry's name put in the config (veRL's registry; a missing name
is the class name without its "Interaction" suffix, lowercased). A record picks one by
`extra_info.interaction_kwargs.name` (veRL requires it); `start_interaction(instance_id, **interaction_kwargs)`
starts the trajectory's episode, and after every assistant turn without a tool call
`generate_response(instance_id, messages, **interaction_kwargs)` gets the whole conversation as OpenAI messages
(the prompt's and every turn since, the assistant's text without its end-of-turn token, as veRL decodes it) and
returns (done, the user's next message, a turn score, metrics). As in veRL's agent loop, the turn scores are not
added to the sample's reward (veRL keeps them aside as `turn_scores`); here they are counted per step
(`multi_turn/interaction_turns`, `multi_turn/interaction_score_sum`). veRL's own interactions run without veRL
(mgrpo/compat/verl/tools.py)."""

from __future__ import annotations

import os
import uuid
from typing import Any

from mgrpo.agent.environment import EnvStep
from mgrpo.agent.tools import load_class
from mgrpo.compat.verl import tools as verl_tools
from mgrpo.config import ConfigError, InputError


def load_interactions(path: str) -> dict[str, Any]:
    """name -> interaction instance, from a veRL interaction config; errors name the file and entry."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"rollout.multi_turn.interaction_config_path={path!r}: file not found")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{path}: expected a top-level 'interaction:' list (veRL's interaction config format)")
    out: dict[str, Any] = {}
    for i, e in enumerate(entries):
        where = f"{path}: interaction[{i}]"
        if not isinstance(e, dict) or not isinstance(e.get("class_name"), str):
            raise InputError(f"{where}: field 'class_name' missing")
        cls = load_class(e["class_name"], verl_tools.BUILTIN_INTERACTIONS, where, os.path.dirname(os.path.abspath(path)))
        simple = e["class_name"].rsplit(".", 1)[-1]
        name = e.get("name") or (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()
        if name in out:
            raise InputError(f"{where}: field 'name': a second interaction named {name!r}")
        out[name] = cls({**(e.get("config") or {}), "name": name})
    return out


class InteractionEnvironment:
    """One trajectory's episode with the interaction its record names (the runner's environment protocol,
    with the conversation: `wants_messages`)."""

    wants_messages = True

    def __init__(self, interactions: dict[str, Any]):
        self.interactions = interactions
        self.instance = None
        self.iid = ""
        self.kwargs: dict = {}
        self.scores: list[float] = []

    async def reset(self, extra_info: dict) -> None:
        kwargs = (extra_info or {}).get("interaction_kwargs")
        if not isinstance(kwargs, dict) or "name" not in kwargs:
            raise InputError("field 'extra_info.interaction_kwargs.name' missing: with "
                             "rollout.multi_turn.interaction_config_path every record names its interaction")
        if kwargs["name"] not in self.interactions:
            raise InputError(f"field 'extra_info.interaction_kwargs.name': {kwargs['name']!r} is not one of the "
                             f"configured interactions {sorted(self.interactions)}")
        self.instance, self.kwargs = self.interactions[kwargs["name"]], kwargs
        self.iid = str(uuid.uuid4())
        await self.instance.start_interaction(self.iid, **kwargs)

    async def step(self, text: str, messages: list[dict]) -> EnvStep:
        done, reply, score, _ = await self.instance.generate_response(self.iid, messages, **self.kwargs)
        if score is not None:
            self.scores.append(float(score))
        return EnvStep(messages=[{"role": "user", "content": reply}], reward=None, done=bool(done))

    async def close(self) -> None:
        if self.instance is not None and hasattr(self.instance, "finalize_interaction"):
            await self.instance.finalize_interaction(self.iid)
