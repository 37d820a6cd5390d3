"""veRL's multi-turn keys (actor_rollout_ref.rollout.multi_turn.*, its ToolAgentLoop settings) -> mgrpo's
rollout.multi_turn.*; part of the key table in rules.py."""

from __future__ import annotations

from mgrpo.compat.verl.kit import R, Rule, ignore, to


def _max_turns(v, ctx):
    if v is None:  # veRL: no limit. mgrpo bounds every trajectory
        return [("", "unlimited in veRL; mgrpo keeps its bound rollout.multi_turn.max_assistant_turns")]
    return [("rollout.multi_turn.max_assistant_turns", int(v))]


def _max_user_turns(v, ctx):
    if v is None:  # veRL: no limit of its own
        return [("", "unlimited in veRL; mgrpo's rollout.multi_turn.max_assistant_turns bounds every trajectory")]
    return [("rollout.multi_turn.max_user_turns", int(v))]


def _interaction(v, ctx):
    if not v:
        return [("", "no interaction")]
    return [("rollout.multi_turn.interaction_config_path", str(v))]


def _function_tools(v, ctx):
    return [("rollout.multi_turn.function_tools", list(v) if isinstance(v, (list, tuple)) else [v])]


# actor_rollout_ref.rollout.multi_turn.* (veRL's ToolAgentLoop settings) -> rollout.multi_turn.*
MULTI_TURN_RULES: dict[str, Rule] = {
    R + "multi_turn.enable": to("rollout.multi_turn.enable", bool),
    R + "multi_turn.max_assistant_turns": _max_turns,
    R + "multi_turn.max_user_turns": _max_user_turns,
    R + "multi_turn.max_parallel_calls": to("rollout.multi_turn.max_parallel_calls", int),
    R + "multi_turn.max_tool_response_length": to("rollout.multi_turn.max_tool_response_length", int),
    R + "multi_turn.tool_response_truncate_side": to("rollout.multi_turn.tool_response_truncate_side", str),
    R + "multi_turn.format": to("rollout.multi_turn.format", str),  # SGLang's parser names (hermes, qwen25, ...)
    R + "multi_turn.tool_config_path": to("rollout.multi_turn.tool_config_path", str),
    R + "multi_turn.function_tool_path": _function_tools,
    R + "multi_turn.interaction_config_path": _interaction,
    R + "multi_turn.use_inference_chat_template": ignore("mgrpo keeps the sampled token ids; the template's own "
                                                         "rendering is only compared (multi_turn/template_drift_tokens)"),
    R + "multi_turn.tokenization_sanity_check_mode": ignore("mgrpo never re-tokenises: it counts drift instead "
                                                            "(multi_turn/template_drift_tokens)"),
}
