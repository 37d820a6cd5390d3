"""Tool calls parsed by SGLang's own `FunctionCallParser` (sglang/srt/function_call/, from the installed wheel).

Importing the `sglang` package runs its CUDA-minded __init__; the function-call modules themselves need only
pydantic, orjson, partial-json-parser, openai's types, pybase64, xgrammar and IPython (which sglang.utils
imports). So the package is registered as a bare namespace pointing at the wheel's folder and
`sglang.srt.function_call.function_call_parser` is imported from it as SGLang itself imports it.

SGLang's parser skips what it cannot use with a log warning: a call whose JSON does not parse, and a call to
an undefined function (unless SGLANG_FORWARD_UNKNOWN_TOOLS). Neither may be silent here: unknown names are
forwarded (the envs override, scoped to the parse) and answered as errors, and calls the parser dropped are
found by counting the format's call openings (`bot_token`) against the calls it returned.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import json
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

from mgrpo.rollout.sglang.protocol.wheel import sglang_dir

_lock = threading.Lock()


@functools.lru_cache(None)
def _sglang_function_call():
    """(FunctionCallParser, Tool, envs) from the installed wheel."""
    d = sglang_dir()
    if d is None:
        raise ImportError("rollout.multi_turn needs SGLang's tool-call parser: pip install --no-deps "
                          "-r requirements-sglang.txt, plus orjson partial-json-parser openai pybase64 xgrammar")
    if "sglang" not in sys.modules:
        # with a spec, as the import system makes a package: importlib.util.find_spec("sglang") (the wheel's
        # other readers, mgrpo.rollout.sglang.protocol.wheel) must keep working in this process
        spec = importlib.machinery.ModuleSpec("sglang", None, is_package=True)
        spec.submodule_search_locations = [d]
        sys.modules["sglang"] = importlib.util.module_from_spec(spec)
    from sglang.srt.entrypoints.openai.protocol import Tool
    from sglang.srt.environ import envs
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    # its per-failure warnings are counted here instead (verl #7177: a log flooded with them)
    logging.getLogger("sglang.srt.function_call").setLevel(logging.ERROR)
    return FunctionCallParser, Tool, envs


def parser_names() -> list[str]:
    return sorted(_sglang_function_call()[0].ToolCallParserEnum)


@dataclass
class ToolCall:
    name: str
    arguments: Optional[dict]
    """Parsed arguments, or None when they are not a JSON object (then `error` says why)."""
    error: Optional[str] = None
    known: bool = True


@dataclass
class ParsedTurn:
    content: str
    """The text outside the calls (SGLang's normal_text)."""
    calls: list[ToolCall] = field(default_factory=list)
    malformed: int = 0
    """Call openings the parser could not turn into a call (bad JSON, cut off by the length limit)."""


class ToolCallParser:
    def __init__(self, fmt: str, schemas: list[dict]):
        FunctionCallParser, Tool, _ = _sglang_function_call()
        if fmt not in FunctionCallParser.ToolCallParserEnum:
            raise ValueError(f"unknown tool-call format {fmt!r}; SGLang 0.5.23 has {parser_names()}")
        self.fmt = fmt
        self.tools = [Tool.model_validate(s) for s in schemas]
        self.known = {t.function.name for t in self.tools}

    def constraint(self, tool_choice: str) -> Optional[tuple[str, str]]:
        """SGLang's tool-call constraint for `tool_choice` ('auto' | 'required'), as serving_chat puts it into
        sampling_params: (kind, value) with kind 'structural_tag' | 'json_schema' | 'ebnf' and the value as
        the JSON string it sends, or None where SGLang constrains nothing ('auto' with no strict tool, or a
        format without a structural tag). FunctionCallParser.get_structure_constraint decides, with
        parallel_tool_calls=True (OpenAI's default) and thinking_mode=False (SGLang's when no reasoning parser
        frames the output: the template's think block is the model's free text)."""
        FunctionCallParser, _, _ = _sglang_function_call()
        if tool_choice == "none" or not self.tools:
            return None
        parser = FunctionCallParser(tools=self.tools, tool_call_parser=self.fmt)
        got = parser.get_structure_constraint(tool_choice, parallel_tool_calls=True, thinking_mode=False)
        if got is None:
            return None
        kind, value = got
        if kind == "structural_tag":  # serving_chat: json.dumps(tag.model_dump(by_alias=True))
            value = json.dumps(value.model_dump(by_alias=True)) if hasattr(value, "model_dump") else json.dumps(value)
        elif not isinstance(value, str):
            value = json.dumps(value)
        return kind, value

    def end_of_call(self) -> str:
        """The text that closes one call in this format, without surrounding whitespace ('</tool_call>' for
        qwen25): what rollout.multi_turn.stop_after_call stops generation on."""
        FunctionCallParser, _, _ = _sglang_function_call()
        detector = FunctionCallParser(tools=self.tools, tool_call_parser=self.fmt).detector
        return (getattr(detector, "eot_token", "") or "").strip()

    def shortest_call(self, name: str) -> Optional[str]:
        """The text of a call of tool `name` with no arguments in this format (a lower bound on any call's
        length), or None for a format without call tags."""
        FunctionCallParser, _, _ = _sglang_function_call()
        detector = FunctionCallParser(tools=self.tools, tool_call_parser=self.fmt).detector
        bot, eot = getattr(detector, "bot_token", "") or "", getattr(detector, "eot_token", "") or ""
        if not bot:
            return None
        return f"{bot}{json.dumps({'name': name, 'arguments': {}})}{eot}"

    def parse(self, text: str) -> ParsedTurn:
        FunctionCallParser, _, envs = _sglang_function_call()
        with _lock, envs.SGLANG_FORWARD_UNKNOWN_TOOLS.override(True):  # the override is process-wide
            parser = FunctionCallParser(tools=self.tools, tool_call_parser=self.fmt)
            bot = (getattr(parser.detector, "bot_token", "") or "").strip()  # e.g. '<tool_call>' for qwen25
            # a format without an opening marker (pythonic's bare list): a call it sees but cannot parse counts
            opened = text.count(bot) if bot else int(parser.has_tool_call(text))
            normal, items = parser.parse_non_stream(text)
        calls = []
        for it in items:
            try:
                args: Any = json.loads(it.parameters) if it.parameters else {}
            except json.JSONDecodeError as e:
                calls.append(ToolCall(it.name, None, error=f"arguments are not JSON ({e.msg})"))
                continue
            if not isinstance(args, dict):
                calls.append(ToolCall(it.name, None, error="arguments must be a JSON object"))
                continue
            known = it.name in self.known
            calls.append(ToolCall(it.name, args, known=known, error=None if known else f"unknown tool {it.name!r}"))
        return ParsedTurn(content=normal, calls=calls, malformed=max(opened - len(items), 0))


def shortest_call_tokens(fmt: str, tools, tokenizer) -> int:
    """Tokens of the shortest call of any of `tools` (a ToolSet) in format `fmt`: a call with no arguments, a
    lower bound on every call's length. 0 without tools or for a format without call tags."""
    names = list(tools.tools)
    if not names:
        return 0
    parser = ToolCallParser(fmt, tools.schemas(names))
    texts = [t for t in (parser.shortest_call(n) for n in names) if t]
    return min((len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts), default=0)


def call_cannot_fit(mt, tools, tokenizer, max_response_length: int, shortest: Optional[int] = None) -> Optional[str]:
    """Why no tool call can complete in an assistant turn (the turn's budget is shorter than the shortest call),
    or None. Said at start and by the planner: such a run trains on cut calls only and never runs a tool.
    `shortest`: shortest_call_tokens when the caller has it already."""
    if shortest is None:
        shortest = shortest_call_tokens(mt.format, tools, tokenizer)
    budget = min(max_response_length, mt.max_tokens_per_turn or max_response_length)
    if shortest <= budget:
        return None
    return (f"no tool call can complete: the shortest (a call with no arguments) is {shortest} tokens and an "
            f"assistant turn may write {budget} (data.max_response_length={max_response_length}, "
            f"rollout.multi_turn.max_tokens_per_turn={mt.max_tokens_per_turn}); every call will be cut as "
            f"'length'. Raise data.max_response_length to at least {shortest} plus the tool replies' tokens")
