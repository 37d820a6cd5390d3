"""Tools a trajectory may call, in the two forms users already write.

1. A plain Python function (sync or async) given by import path `module:function` or `path/file.py:function`:
   its type hints and docstring become the OpenAI function schema the chat template renders (the idea of
   veRL's `@function_tool` and TRL's environment methods). Google-style `Args:` lines describe parameters.
2. veRL's stateful tool: a class with `create / execute / calc_reward / release`, listed in a veRL tool-config
   YAML exactly as veRL writes it:
       tools:
         - class_name: my_pkg.tools.Calculator
           config: {type: native}
           tool_schema: {type: function, function: {name: calc, description: ..., parameters: {...}}}
   The class is built as veRL builds it, `cls(config=config, tool_schema=schema)`; `execute` may return
   veRL's `(response, reward, metrics)` or just the response; a response is a string, a dict with "text",
   or an object with `.text` (veRL's ToolResponse). veRL's own tools (`verl.tools.gsm8k_tool.Gsm8kTool`)
   run as written, without veRL installed (mgrpo/compat/verl/tools.py).

Per record: `extra_info.tools_kwargs[name]` holds `create_kwargs` (passed to create), `execute_kwargs`
(merged into every execute call) and `calc_reward_kwargs`, as veRL reads them; `extra_info.tools` (a list of
names) selects a subset of the tools for that record.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from mgrpo.agent.threads import run_sync
from mgrpo.compat.verl import tools as verl_tools
from mgrpo.config import ConfigError, InputError

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def load_object(spec: str, what: str) -> Any:
    """`module:name` or `path/to/file.py:name` (imported as reward files are: mgrpo/rewards/registry.py) -> the
    object (ConfigError naming `what` when missing)."""
    from mgrpo.rewards.registry import _import_file

    if ":" not in spec:
        raise ConfigError(f"{what}={spec!r}: expected 'module:name' or 'path/to/file.py:name'")
    mod_name, _, attr = spec.rpartition(":")
    try:
        if mod_name.endswith(".py"):
            if not os.path.isfile(mod_name):
                raise ConfigError(f"{what}={spec!r}: file {mod_name} not found")
            mod = _import_file(mod_name)
        else:
            mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"{what}={spec!r}: cannot import {mod_name} ({e}); the module must be importable where "
                          f"the run starts (its folder on PYTHONPATH, or installed), or give its file: "
                          f"'{mod_name.replace('.', '/')}.py:{attr}'") from e
    if not hasattr(mod, attr):
        raise ConfigError(f"{what}={spec!r}: {mod_name} has no {attr!r}")
    return getattr(mod, attr)


def _json_type(hint: Any) -> dict:
    origin = typing.get_origin(hint)
    if origin is typing.Union:  # Optional[X]: the schema of X
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(typing.get_args(hint)[0]), "string"), "enum": list(typing.get_args(hint))}
    if origin in (list, tuple):
        inner = typing.get_args(hint)
        return {"type": "array", **({"items": _json_type(inner[0])} if inner else {})}
    if origin is dict:
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    raise TypeError(f"type {hint!r} has no JSON-schema form (use str, int, float, bool, list, dict, Literal)")


def _doc_parts(doc: str) -> tuple[str, dict[str, str]]:
    """The summary (text before `Args:`) and the `name: description` lines under `Args:`."""
    doc = inspect.cleandoc(doc or "")
    head, _, rest = doc.partition("\nArgs:")
    params: dict[str, str] = {}
    for line in rest.splitlines():
        m = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.*)", line)
        if m:
            params[m.group(1)] = m.group(2).strip()
        elif line.strip() and not line.startswith(" "):
            break  # Returns:, Raises:, ...
    return " ".join(head.split()), params


def function_schema(fn: Callable, strict: bool = False) -> dict:
    """The OpenAI function-tool schema of a plain function: name, docstring summary, parameters from hints;
    keyword-only parameters (after `*`) are hidden (the model never sees them: `FunctionTool`). `strict`: the
    schema is marked strict (SGLang's grammar then writes the arguments by it, not as any JSON)."""
    hints = typing.get_type_hints(fn)
    summary, descs = _doc_parts(fn.__doc__ or "")
    props, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY):
            continue
        if name not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter {name!r} has no type hint (the schema needs one)")
        try:
            props[name] = {**_json_type(hints[name]), **({"description": descs[name]} if name in descs else {})}
        except TypeError as e:
            raise TypeError(f"tool {fn.__name__}: parameter {name!r}: {e}") from None
        if p.default is p.empty:
            required.append(name)
    function = {"name": fn.__name__, "description": summary,
                "parameters": {"type": "object", "properties": props, "required": required}}
    return {"type": "function", "function": {**function, "strict": True} if strict else function}


def function_tools_strict(tool_choice: str, required_per_group: int, strict: Optional[bool]) -> bool:
    """rollout.multi_turn.strict_function_tools resolved: None = strict when some turns are forced to call
    (tool_choice=required or required_per_group > 0: the grammar writes those calls, and a tool that is not
    strict gives it an empty arguments schema, so it writes any JSON, e.g. `"arguments": true`); not strict
    otherwise (tool_choice=auto then constrains no function tool, as SGLang)."""
    if strict is not None:
        return bool(strict)
    return tool_choice == "required" or required_per_group > 0


@dataclass
class ToolResult:
    text: str
    reward: Optional[float] = None
    """A step reward the tool gave (veRL's execute returns one); summed into the trajectory's tool reward."""
    metrics: dict = field(default_factory=dict)


def as_text(response: Any) -> str:
    """veRL's ToolResponse (`.text`), a dict with 'text', or anything printable -> the text sent back."""
    if isinstance(response, str):
        return response
    if isinstance(response, dict) and "text" in response:
        return str(response["text"] or "")
    text = getattr(response, "text", None)
    return str(text) if text is not None else str(response)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class BadArguments(TypeError):
    """The call's arguments do not fit the tool's parameters (counted as bad_arguments, not as the tool failing)."""


class BaseTool:
    """veRL's tool lifecycle (verl/tools/base_tool.py), for stateful tools. Subclass and override; a class
    written against veRL's own BaseTool with the same method names works too (it is duck-typed)."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> dict:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> str:
        return instance_id or str(uuid.uuid4())

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[Any, float, dict]:
        raise NotImplementedError

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


class FunctionTool(BaseTool):
    """A plain function as a tool: execute calls it with the parsed arguments (sync functions run in a daemon
    thread, so a slow one holds only its own trajectory). Its keyword-only parameters are hidden per-record
    values, as a veRL tool's: not in the schema, never the model's to set, filled from the record's
    `extra_info.tools_kwargs[name]` (`create_kwargs`, then `execute_kwargs` over them).

    `strict`: its schema is strict (see `function_tools_strict`); the function's own `strict` attribute
    (`my_tool.strict = False`) overrides the run's choice for that tool."""

    def __init__(self, fn: Callable, strict: bool = False):
        own = getattr(fn, "strict", None)
        super().__init__({}, function_schema(fn, strict=bool(strict if own is None else own)))
        self.fn = fn
        self.signature = inspect.signature(fn)
        self.hidden = {n for n, p in self.signature.parameters.items() if p.kind == p.KEYWORD_ONLY}
        self.records: dict[str, dict] = {}
        """instance id -> its record's create_kwargs (until release)."""

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> str:
        iid = instance_id or str(uuid.uuid4())
        self.records[iid] = kwargs
        return iid

    async def release(self, instance_id: str, **kwargs) -> None:
        self.records.pop(instance_id, None)

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[Any, float, dict]:
        sig = self.signature
        hidden = sorted(self.hidden & set(parameters))
        if hidden:
            raise BadArguments(f"{', '.join(map(repr, hidden))} cannot be given (not a parameter of the tool)")
        per_record = {**self.records.get(instance_id, {}), **kwargs}
        args = {**{k: v for k, v in per_record.items() if k in sig.parameters}, **parameters}
        missing = sorted(n for n in self.hidden - set(args) if sig.parameters[n].default is inspect.Parameter.empty)
        if missing:
            raise TypeError(f"hidden parameter(s) {missing} have no value: the record gives them in "
                            f"extra_info.tools_kwargs.{self.name}.create_kwargs (or execute_kwargs)")
        try:
            sig.bind(**args)
        except TypeError as e:
            raise BadArguments(str(e)) from None
        if inspect.iscoroutinefunction(self.fn):
            out = await self.fn(**args)
        else:  # a daemon thread: one that hangs past tool_timeout_s never holds the process at exit
            out = await run_sync(self.fn, **args)
        return out, None, {}


def load_class(class_name: str, builtins: dict, where: str, folder: str = "") -> type:
    """A veRL config's `class_name`: veRL's own classes from `builtins` (they run without veRL), a file as reward
    files are given ('path/to/file.py:Class', relative to the working directory or else to `folder`, the
    config's), any other by import; InputError naming `where` and the field when it cannot be loaded."""
    cls = builtins.get(class_name)
    if cls is not None:
        return cls
    if class_name.partition(":")[0].endswith(".py"):
        path, _, attr = class_name.partition(":")
        if not os.path.isfile(path) and folder and os.path.isfile(os.path.join(folder, path)):
            path = os.path.join(folder, path)
        try:
            return load_object(f"{path}:{attr}", "class_name")
        except ConfigError as err:
            raise InputError(f"{where}: field 'class_name': {err}") from None
    mod, _, cls_name = class_name.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), cls_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise InputError(f"{where}: field 'class_name': cannot load {class_name!r} ({err}); the module must be "
                         f"importable (its folder on PYTHONPATH, or installed), or give its file: "
                         f"'{mod.replace('.', '/')}.py:{cls_name}'") from err


def load_verl_tool_config(path: str) -> list[BaseTool]:
    """The tools of a veRL tool-config YAML (see the module docstring); errors name the file and entry."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"rollout.multi_turn.tool_config_path={path!r}: file not found")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    entries = data.get("tools") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise InputError(f"{path}: expected a top-level 'tools:' list (veRL's tool config format)")
    tools = []
    for i, e in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(e, dict) or "class_name" not in e:
            raise InputError(f"{where}: field 'class_name' missing")
        schema = e.get("tool_schema")
        if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict) \
                or "name" not in schema["function"]:
            raise InputError(f"{where}: field 'tool_schema.function.name' missing")
        cls = load_class(e["class_name"], verl_tools.BUILTIN_TOOLS, where, os.path.dirname(os.path.abspath(path)))
        tools.append(cls(config=e.get("config") or {}, tool_schema=schema))
    return tools


class ToolSet:
    """The run's tools by name, and which of them a record may use."""

    def __init__(self, tools: list):
        self.tools: dict[str, Any] = {}
        for t in tools:
            name = t.tool_schema["function"]["name"] if hasattr(t, "tool_schema") else t.name
            if name in self.tools:
                raise ConfigError(f"two tools are named {name!r}")
            self.tools[name] = t

    @classmethod
    def from_config(cls, function_tools: list[str], tool_config_path: Optional[str], strict: bool = False
                    ) -> "ToolSet":
        """`strict`: the function tools' schemas are strict (`function_tools_strict`)."""
        tools: list = [FunctionTool(load_object(spec, "rollout.multi_turn.function_tools"), strict)
                       for spec in function_tools]
        if tool_config_path:
            tools += load_verl_tool_config(tool_config_path)
        return cls(tools)

    def for_record(self, extra_info: dict, where: str = "") -> list[str]:
        """Names of the tools a record may use: `extra_info.tools` when it lists some, else all."""
        names = (extra_info or {}).get("tools")
        if names is None:
            return list(self.tools)
        bad = [n for n in names if n not in self.tools]
        if bad:
            raise InputError(f"{where}: field 'extra_info.tools' names unknown tool(s) {bad}; known: {sorted(self.tools)}")
        return list(names)

    def schemas(self, names: list[str]) -> list[dict]:
        return [self.tools[n].tool_schema for n in names]
