"""rollout.multi_turn: agentic multi-turn rollouts (mgrpo/agent/), in a module of its own to keep schema.py small."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from mgrpo.config.choices import OnToolError, ToolChoice, TruncateSide


@dataclass
class MultiTurnConfig:
    """Agentic multi-turn rollouts (veRL's actor_rollout_ref.rollout.multi_turn.*; mgrpo/agent/): each sample is
    a conversation in which the model calls tools; only the tokens it sampled carry loss."""

    enable: bool = False
    max_assistant_turns: int = 5
    """Assistant turns per trajectory; a trajectory still calling tools after this many ends as max_turns."""
    max_parallel_calls: int = 4
    """Tool calls executed per assistant turn; further calls in the same turn are answered with an error."""
    max_tool_response_length: int = 256
    """Characters of one tool reply kept (longer replies are truncated, marked '...(truncated)', counted)."""
    tool_response_truncate_side: TruncateSide = "middle"
    """left (keep the start) | right (keep the end) | middle (both ends), as veRL."""
    max_tokens_per_turn: int = 0
    """New tokens of one assistant turn; 0 = what is left of data.max_response_length (always clamped to it)."""
    format: str = "qwen25"
    """SGLang's tool-call parser (FunctionCallParser): qwen25 for Qwen2.5/Qwen3's <tool_call>{json}</tool_call>,
    qwen3_coder for its XML form, or any other name SGLang 0.5.23 knows."""
    function_tools: list[str] = field(default_factory=list)
    """Plain Python functions as tools, by import path (module:function or path/file.py:function). Keyword-only
    parameters (after `*`) are hidden from the model and filled per record from extra_info.tools_kwargs."""
    strict_function_tools: Optional[bool] = None
    """Mark the function tools' schemas `strict` (SGLang's grammar then writes a constrained call's arguments by
    the schema instead of as any JSON). null: strict when some turns are forced (tool_choice=required or
    required_per_group > 0), where a tool that is not strict lets the grammar write `"arguments": true`; not
    strict otherwise (tool_choice=auto constrains only strict tools). A function's own `strict` attribute
    (`my_tool.strict = False`) overrides this for that tool."""
    tool_config_path: Optional[str] = None
    """A veRL tool-config YAML (tools: [{class_name, config, tool_schema}])."""
    environment: Optional[str] = None
    """An environment class by import path (module:Class): one instance per trajectory, `reset(extra_info)`,
    then `step(assistant_text)` after every assistant turn without tool calls -> (messages, reward, done);
    its messages (e.g. a user simulator's) continue the conversation (mgrpo/agent/environment.py)."""
    interaction_config_path: Optional[str] = None
    """A veRL interaction config YAML (interaction: [{name, class_name, config}]; veRL's BaseInteraction): the
    environment of every trajectory, the interaction its record names in extra_info.interaction_kwargs.name
    (mgrpo/agent/interaction.py). Not together with `environment`."""
    max_user_turns: int = 0
    """Environment (user) turns per trajectory, veRL's max_user_turns; 0: bounded by max_assistant_turns only.
    A trajectory that reaches it ends as max_turns."""
    tool_timeout_s: float = 30.0
    """One tool call's limit; a call past it ends the trajectory as tool_timeout (dropped from the loss and
    its group's baseline, counted)."""
    trajectory_timeout_s: float = 600.0
    """One trajectory's wall-clock limit (generation and tools, every retry included); past it:
    trajectory_timeout, dropped, counted."""
    trajectory_retries: int = 1
    """A trajectory that ended tool_timeout or env_failed (a tool or environment that hung or raised: user code,
    often a transient fault) is generated again from its prompt, at most this many times, with the same
    per-turn seeds, so a fault that does not recur gives exactly the trajectory the fault-free run drew; only
    when they run out does it end failed (out of the loss and its group's baseline). Counted:
    multi_turn/trajectory_retries and .../<reason>. 0: off. Default 1: one retry heals a one-off hang or crash
    at the cost of at most one more tool_timeout_s for a tool that always hangs, all within
    trajectory_timeout_s; more retries mostly repeat a fault that is not transient."""
    keep_thinking: bool = True
    """Earlier turns keep their <think> blocks in the context of later turns: the model generated every turn
    seeing them, so this is what it was sampled from and what it trains on (token-in, token-out). False is
    refused for now: dropping them means re-rendering the context per turn (Qwen3's official view; verl #6854)."""
    on_tool_error: OnToolError = "reply"
    """A malformed call, an unknown tool or bad arguments: reply (the error goes back as the tool's reply,
    counted) | mask (the same, and the trajectory is kept out of the loss)."""
    tool_choice: ToolChoice = "auto"
    """OpenAI's and SGLang's tool_choice for every assistant turn: auto | required. The runner sends the
    constraint SGLang's chat serving would (FunctionCallParser.get_structure_constraint) as sampling_params:
    for qwen25, a structural tag whose trigger `<tool_call>` hands the call to the grammar (the name, and
    arguments per the tool's JSON schema). 'auto' constrains only tools marked `strict: true` in their schema
    (as SGLang); 'required' makes a turn call a tool (see reset_tool_choice). Tokens the grammar restricted
    are context: not the policy's choice, no loss, no behaviour log-prob (mgrpo/rollout/grammar.py)."""
    required_per_group: int = 0
    """Of each prompt's rollout.n samples, the first this many start their first assistant turn under
    tool_choice=required (the grammar writes the call: context, no loss) and the rest under `tool_choice`, which
    must be auto: guided exploration for a policy that does not call yet. The forced samples learn what to do
    with the tool's reply; once that pays, a free sample that calls scores like them while one that does not
    scores what it guesses, and the group's advantage raises the free call rate (multi_turn/free_call_rate).
    Mixing forced and free samples in one GRPO group is sound: the baseline is a per-prompt constant, which
    biases no sample's gradient, and the forced samples' call tokens are context (no loss, no log-prob), so
    every token with a loss was still sampled by the policy from the context it saw. The forced samples are the
    first k sample indices of each group, a function of the batch position alone (the same on resume and under
    rollout.async_mode). Training batches only: a validation is free. 0: off. (A brief search of veRL's, TRL's,
    SkyRL's and ROLL's issues and code found no such key.)"""
    reset_tool_choice: bool = True
    """After a turn that called a tool, the next turns use tool_choice=auto (the OpenAI Agents SDK's
    `reset_tool_choice`, default True there too: with 'required' on every turn a trajectory could never
    answer)."""
    stop_after_call: bool = False
    """End an assistant turn when a tool call closes (SGLang's sampling_params.stop: the format's end-of-call
    text, `</tool_call>` for qwen25); the end-of-turn token the model did not sample is then inserted as
    context before the tool's reply. SGLang matches a stop only in the last (its length in tokens + 1) tokens,
    so an end spelled in more tokens is cut by the runner instead (tokens past it dropped, counted)."""
    recheck_routes: bool = False
    """actor.router_replay=rollout (R3): every turn asks for the routed experts of its whole sequence, not only of
    the positions its trajectory has no route for yet (SGLang's routed_experts_start_len), and the rows it
    returns again for earlier positions are compared with the earlier turns' (multi_turn/
    route_rows_recomputed_differ: positions the engine computed again and routed otherwise, e.g. a prefix-cache
    miss). A diagnostic: the route bytes of a trajectory grow with turns x length instead of its length."""
    max_concurrent_per_engine: int = 64
    """Trajectories in flight per rollout engine; each advances on its own."""
