"""Checks of single config groups, each returning its error lines, collected by `validate.field_errors` (the one
validator): the primitive checks, and the groups that live in files of their own (rollout.multi_turn, sandbox,
reward.models / services / compose). `mgrpo-sandbox` checks its flags with `sandbox_errors` too."""

from __future__ import annotations

import os
import re
from typing import Optional

from mgrpo.config.choices import (Isolation, JudgeParser, OnToolError, RewardModelKind, RewardPlacement, ToolChoice,
                                  TruncateSide, is_choice, values)
from mgrpo.config.multi_turn import MultiTurnConfig
from mgrpo.config.sandbox import SandboxConfig


# SGLang 0.5.23's limits on a request's stops (sampling/sampling_params.py; rollout/stops.py applies them)
MAX_STOP_COUNT = 32  # MAX_STOP_COUNT
MAX_STOP_REGEX_COUNT = 32  # MAX_STOP_REGEX_COUNT
MAX_STOP_REGEX_LEN = 256  # MAX_STOP_REGEX_LEN, in UTF-8 bytes


def stop_errors(stop, stop_regex) -> list[str]:
    """rollout.stop / rollout.stop_regex within SGLang's limits: at most 32 of each, non-empty strings, a pattern
    at most 256 UTF-8 bytes that `re` compiles (SGLang refuses the request otherwise)."""
    e: list[str] = []
    for key, vals, most in (("stop", stop, MAX_STOP_COUNT), ("stop_regex", stop_regex, MAX_STOP_REGEX_COUNT)):
        if len(vals) > most:
            e.append(f"rollout.{key} holds {len(vals)} entries; SGLang takes at most {most}")
        for i, v in enumerate(vals):
            if not isinstance(v, str) or not v:
                e.append(f"rollout.{key}[{i}]={v!r} must be a non-empty string")
            elif key == "stop_regex":
                if len(v.encode()) > MAX_STOP_REGEX_LEN:
                    e.append(f"rollout.stop_regex[{i}] is {len(v.encode())} bytes; SGLang takes at most "
                             f"{MAX_STOP_REGEX_LEN}")
                try:
                    re.compile(v)
                except re.error as err:
                    e.append(f"rollout.stop_regex[{i}]={v!r} does not compile: {err}")
    return e


def choice(errors: list[str], name: str, value, allowed) -> None:
    names = values(allowed) if isinstance(allowed, type) else list(allowed)
    if value not in names:
        errors.append(f"{name}='{value!s}' is not one of {names}")


def divides(errors: list[str], a_name: str, a: int, b_name: str, b: int) -> None:
    if a <= 0:
        errors.append(f"{a_name}={a} must be positive")
    elif b % a != 0:
        errors.append(f"{a_name}={a} does not divide {b_name}={b}")


def positive(errors: list[str], prefix: str, obj, names) -> None:
    for name in names:
        if getattr(obj, name) <= 0:
            errors.append(f"{prefix}.{name}={getattr(obj, name)} must be positive")


def multi_turn_errors(m: MultiTurnConfig, tokenizer: str, n: Optional[int] = None) -> list[str]:
    """rollout.multi_turn, when enabled; `n`: rollout.n (required_per_group's bound; None: not checked)."""
    e: list[str] = []
    if not m.enable:
        return e
    for key, v in (("max_assistant_turns", m.max_assistant_turns), ("max_parallel_calls", m.max_parallel_calls),
                   ("max_tool_response_length", m.max_tool_response_length),
                   ("max_concurrent_per_engine", m.max_concurrent_per_engine)):
        if v < 1:
            e.append(f"rollout.multi_turn.{key}={v} must be at least 1")
    if m.max_tokens_per_turn < 0:
        e.append(f"rollout.multi_turn.max_tokens_per_turn={m.max_tokens_per_turn} must be >= 0 (0: the rest of "
                 "data.max_response_length)")
    for key, choice in (("tool_response_truncate_side", TruncateSide), ("on_tool_error", OnToolError),
                        ("tool_choice", ToolChoice)):
        if not is_choice(getattr(m, key), choice):
            e.append(f"rollout.multi_turn.{key}={getattr(m, key)!r}: {' | '.join(values(choice))}")
    k = m.required_per_group
    if k < 0 or (n is not None and k > n):
        e.append(f"rollout.multi_turn.required_per_group={k} must be in [0, rollout.n={n}]" if n is not None else
                 f"rollout.multi_turn.required_per_group={k} must be >= 0")
    elif k > 0:
        if m.tool_choice != "auto":
            e.append(f"rollout.multi_turn.required_per_group={k} forces the call of some samples and leaves the "
                     f"others to rollout.multi_turn.tool_choice, which must then be auto (is {m.tool_choice!r})")
        if not m.reset_tool_choice:
            e.append(f"rollout.multi_turn.required_per_group={k} needs rollout.multi_turn.reset_tool_choice=true: "
                     "a forced sample would otherwise be made to call on every turn and never answer")
        if not m.function_tools and not m.tool_config_path:
            e.append(f"rollout.multi_turn.required_per_group={k} needs tools to call "
                     "(rollout.multi_turn.function_tools or tool_config_path)")
    if not m.keep_thinking:
        e.append("rollout.multi_turn.keep_thinking=False is not implemented: earlier turns keep their <think> "
                 "blocks (what each turn was sampled from)")
    if m.trajectory_retries < 0:
        e.append(f"rollout.multi_turn.trajectory_retries={m.trajectory_retries} must be >= 0 (0: a trajectory whose "
                 "tool or environment hung or raised ends failed at once)")
    if m.tool_timeout_s <= 0 or m.trajectory_timeout_s <= 0:
        e.append(f"rollout.multi_turn.tool_timeout_s={m.tool_timeout_s} and trajectory_timeout_s="
                 f"{m.trajectory_timeout_s} must be positive")
    if not m.function_tools and not m.tool_config_path and not m.environment and not m.interaction_config_path:
        e.append("rollout.multi_turn.enable=True needs tools or an environment: rollout.multi_turn.function_tools, "
                 "rollout.multi_turn.tool_config_path, rollout.multi_turn.environment or "
                 "rollout.multi_turn.interaction_config_path")
    for key in ("tool_config_path", "interaction_config_path"):
        path = getattr(m, key)
        if path and not os.path.isfile(path):
            e.append(f"rollout.multi_turn.{key}={path!r}: file not found")
    if m.environment and m.interaction_config_path:
        e.append("rollout.multi_turn.environment and rollout.multi_turn.interaction_config_path are two environments "
                 "for one trajectory: set one")
    if m.max_user_turns < 0:
        e.append(f"rollout.multi_turn.max_user_turns={m.max_user_turns} must be >= 0 (0: no bound of its own)")
    if tokenizer == "synthetic":
        e.append("rollout.multi_turn.enable=True needs a tokenizer with a chat template (model.tokenizer=qwen3 "
                 "or a directory); 'synthetic' has none")
    return e


def sandbox_errors(s: SandboxConfig) -> list[str]:
    """The sandbox's limits (mgrpo-sandbox checks its flags with this too). Whether the machine gives the
    isolation asked for is a capability check: mgrpo.sandbox.isolation.resolve."""
    e: list[str] = []
    choice(e, "sandbox.isolation", s.isolation, Isolation)
    positive(e, "sandbox", s, ("cpu_time_s", "wall_time_s", "max_file_size_mb", "scratch_mb",
                                "max_output_bytes", "max_concurrency"))
    if s.max_processes < 2:  # the stub and the code it runs
        e.append(f"sandbox.max_processes={s.max_processes} must be at least 2")
    if s.max_open_files < 8:  # stdin/out/err, the code's pipe and the interpreter's own files
        e.append(f"sandbox.max_open_files={s.max_open_files} must be at least 8")
    if s.memory_mb < 64:
        e.append(f"sandbox.memory_mb={s.memory_mb} must be at least 64 (the interpreter alone maps about 30 MiB)")
    if s.pool_size < 0:
        e.append(f"sandbox.pool_size={s.pool_size} must be at least 0")
    if s.uid <= 0:
        e.append(f"sandbox.uid={s.uid} must be a positive uid (never root)")
    return e


def judge_errors(where: str, j) -> list[str]:
    """A generative judge's settings: one template, its parser's settings usable, its OpenAI endpoint named with a key
    variable that is set. (The template's Jinja is checked with the reward functions, rewards/judge.py::check_judges:
    config imports no Jinja.)"""
    e: list[str] = []
    if bool(j.template) == bool(j.template_file):
        e.append(f"{where}: give exactly one of template (inline) and template_file")
    if j.template_file and not os.path.isfile(j.template_file):
        e.append(f"{where}.template_file={j.template_file}: no such file")
    if not is_choice(j.parser, JudgeParser):
        choice(e, f"{where}.parser", j.parser, JudgeParser)
    if j.parser == JudgeParser.number:
        try:
            re.compile(j.pattern)
        except re.error as err:
            e.append(f"{where}.pattern={j.pattern!r}: not a regular expression ({err})")
    if len(j.range) != 2 or not float(j.range[0]) < float(j.range[1]):
        e.append(f"{where}.range={list(j.range)}: [low, high] with low < high")
    if j.parser == JudgeParser.yes_no and (not j.yes or not j.no or j.yes == j.no or j.top_logprobs < 1):
        e.append(f"{where}: yes={j.yes!r} and no={j.no!r} must be two different tokens and top_logprobs="
                 f"{j.top_logprobs} at least 1")
    if j.max_new_tokens < 1 or j.temperature < 0 or j.concurrency < 1:
        e.append(f"{where}: max_new_tokens={j.max_new_tokens} and concurrency={j.concurrency} must be at least 1, "
                 f"temperature={j.temperature} non-negative")
    if j.openai_url is not None:
        if not str(j.openai_url).startswith(("http://", "https://")):
            e.append(f"{where}.openai_url={j.openai_url!r}: an http:// or https:// URL")
        if not j.openai_model:
            e.append(f"{where}.openai_model is empty: name the model the endpoint serves")
    if j.api_key_env and not os.environ.get(j.api_key_env):
        e.append(f"{where}.api_key_env={j.api_key_env}: the variable is not set (or empty)")
    return e


def reward_model_errors(rw) -> list[str]:
    e: list[str] = []
    for name, m in rw.models.items():
        where = f"reward.models.{name}"
        if name == "rule" or not name.replace("_", "").replace("-", "").isalnum():
            e.append(f"{where}: a reward model's name is letters, digits, '-' and '_', and not 'rule' (the rule's)")
        if not is_choice(m.kind, RewardModelKind):
            choice(e, f"{where}.kind", m.kind, RewardModelKind)
        elif m.kind == RewardModelKind.generative:
            e.extend(judge_errors(f"{where}.judge", m.judge))
        if not m.hf_path and not m.url and not (m.kind == RewardModelKind.generative and m.judge.openai_url):
            e.append(f"{where}.hf_path is empty: name the reward model's HF checkpoint (or its server's url)")
        if m.engines < 1 or m.tp < 1 or m.batch_size < 1 or m.max_retries < 0 or m.timeout_s <= 0:
            e.append(f"{where}: engines={m.engines}, tp={m.tp}, batch_size={m.batch_size} must be at least 1, "
                     f"max_retries={m.max_retries} non-negative and timeout_s={m.timeout_s} positive")
        if not is_choice(m.placement, RewardPlacement):
            choice(e, f"{where}.placement", m.placement, RewardPlacement)
        if m.gpu_memory_utilization is not None and not 0 < m.gpu_memory_utilization < 1:
            e.append(f"{where}.gpu_memory_utilization={m.gpu_memory_utilization}: a share of the card in (0, 1)")
        if any(str(a).startswith(("--api-key", "--admin-api-key", "--host", "--port", "--model-path",
                                  "--mem-fraction-static"))
               for a in m.server_args):
            e.append(f"{where}.server_args: the key, host, port, model path and memory share are the run's to set "
                     "(the share is gpu_memory_utilization), not server_args")
    for name, sv in rw.services.items():
        where = f"reward.services.{name}"
        if name == "rule" or name in rw.models:
            e.append(f"{where}: the name is the rule's or a reward model's already")
        if not sv.url.startswith(("http://", "https://")):
            e.append(f"{where}.url={sv.url!r}: an http:// or https:// URL")
        if sv.timeout_s <= 0 or sv.max_retries < 0 or sv.backoff_s < 0 or sv.concurrency < 1:
            e.append(f"{where}: timeout_s={sv.timeout_s} and concurrency={sv.concurrency} must be positive, "
                     f"max_retries={sv.max_retries} and backoff_s={sv.backoff_s} non-negative")
        if sv.api_key_env and not os.environ.get(sv.api_key_env):
            e.append(f"{where}.api_key_env={sv.api_key_env}: the variable is not set (or empty)")
    for src, weights in rw.compose.items():
        for scorer in weights:
            if scorer != "rule" and scorer not in rw.models and scorer not in rw.services:
                e.append(f"reward.compose[{src!r}]: {scorer!r} is neither 'rule' nor a reward.models or "
                         f"reward.services entry ({sorted({*rw.models, *rw.services}) or 'none'})")
    return e
