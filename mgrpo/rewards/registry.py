"""Reward functions keyed by data_source, with veRL's signature:

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float
    (a dict with a 'score' key is accepted too; its other keys are ignored)

Built-ins cover GSM8K, the math datasets (math-verify) and the synthetic tasks; users add or
override sources with reward.custom_functions = {data_source: 'module:function'}, where the module is an
import path or a file (`path/to/my_reward.py:score`, no PYTHONPATH needed). The data_source '*' is veRL's
`custom_reward_function`: one function for every data_source that has no function of its own (built-ins
included, as veRL's custom function replaces its default scorer). An unknown data_source is an error naming
it and the known ones, raised by `check_data_sources` before any process starts, which also imports each
user function and calls it once on a record of its data_source; `mgrpo.preflight` asks `BUILTIN_REWARDS`
about the config.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import sys
from typing import Callable, Iterable, Optional

from mgrpo.config import ConfigError
from mgrpo.config.registry import target_error
from mgrpo.config.schema import RewardConfig
from mgrpo.rewards import gsm8k, math_reward, synthetic

RewardFn = Callable[[str, str, str, Optional[dict]], "float | dict"]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "openai/gsm8k": gsm8k.compute_score,
    **{src: math_reward.compute_score for src in math_reward.SOURCES},
    "mgrpo/sum": synthetic.sum_score,
    "mgrpo/peek": synthetic.peek_score,
}
"""The built-in judges with their default options (reward.gsm8k: strict, format_score 0)."""

IN_PROCESS_SAFE = frozenset({"mgrpo/sum", "mgrpo/peek", "openai/gsm8k"})
"""Built-ins the Rules may call in its own process: a few string operations and regexes without nested
quantifiers over at most the response (GSM8K's over its last 300 characters; peek's think-block removal is at worst
quadratic in the response's length, bounded by data.max_response_length), no imports, nothing that can hang, exit
or leak. math-verify is not among them (sympy parsing can hang: it stays in the workers)."""


def runs_in_process(data_source: str, cfg: RewardConfig) -> bool:
    """Whether the Rules scores `data_source` in its own process although it has workers: a built-in of
    IN_PROCESS_SAFE that no user function replaces, unless reward.isolate_builtin_rules."""
    return (not cfg.isolate_builtin_rules and data_source in IN_PROCESS_SAFE
            and data_source not in cfg.custom_functions and EVERY_SOURCE not in cfg.custom_functions)


def builtin_rewards(gsm8k_options: Optional[dict] = None) -> dict[str, RewardFn]:
    """The built-in judges, GSM8K's with reward.gsm8k's options ({"method", "format_score"})."""
    fns = dict(BUILTIN_REWARDS)
    if gsm8k_options:
        fns["openai/gsm8k"] = functools.partial(gsm8k.compute_score, method=str(gsm8k_options["method"]),
                                                format_score=float(gsm8k_options["format_score"]))
    return fns


def gsm8k_options(cfg: RewardConfig) -> dict:
    """reward.gsm8k as plain JSON values (what the reward workers are sent)."""
    return {"method": str(cfg.gsm8k.method), "format_score": float(cfg.gsm8k.format_score)}


def spec_error(spec: str, data_source: str = "?") -> Optional[str]:
    """Why `spec` is not a 'package.module:function' (naming the config entry), or None if it is one."""
    return target_error(spec, f"reward.custom_functions[{data_source!r}]", "function")


EVERY_SOURCE = "*"
"""reward.custom_functions' key for veRL's custom_reward_function: every data_source without its own."""
ADD_ONE = "Add one with reward.custom_functions={data_source: 'module:function'} (or 'path/to/file.py:function')"


def is_file_spec(spec: str) -> bool:
    """Whether a spec names its module by file ('path/to/file.py:function') rather than by import path."""
    return spec.partition(":")[0].endswith(".py")


def absolute_spec(spec: str) -> str:
    """A file spec with its path made absolute (against this process's working directory); others unchanged.
    Reward workers get absolute paths, so a relative one means the folder the run was started from."""
    if not is_file_spec(spec):
        return spec
    path, _, attr = spec.partition(":")
    return f"{os.path.abspath(path)}:{attr}"


def _import_file(path: str):
    """The module in `path`, imported once per process under a name derived from its absolute path."""
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no file {path}")
    name = "mgrpo_user_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def load_function(spec: str, data_source: str = "?") -> RewardFn:
    """Import 'package.module:function' or 'path/to/file.py:function'; errors name the config entry."""
    where = f"reward.custom_functions[{data_source!r}]={spec!r}"
    problem = spec_error(spec, data_source)
    if problem:
        raise ConfigError(problem)
    module_name, _, attr = spec.partition(":")
    try:
        module = _import_file(module_name) if is_file_spec(spec) else importlib.import_module(module_name)
    except Exception as e:
        hint = "" if is_file_spec(spec) else (
            "; the module must be importable where the run starts (its folder on PYTHONPATH, or installed), "
            f"or give its file: '{module_name.replace('.', '/')}.py:{attr}'")
        raise ConfigError(f"{where}: cannot import {module_name!r} ({type(e).__name__}: {e}){hint}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{where}: {module_name!r} has no function {attr!r}")
    return fn


def reward_functions(cfg: RewardConfig) -> dict[str, RewardFn]:
    """Built-ins (with reward.gsm8k's options) overlaid with the user's functions (a custom function replaces a
    built-in). With the '*' entry (veRL's custom_reward_function) the built-ins are gone: '*' scores every
    data_source that has no function of its own."""
    custom = dict(cfg.custom_functions)
    fns = {} if EVERY_SOURCE in custom else builtin_rewards(gsm8k_options(cfg))
    for src, spec in custom.items():
        fns[src] = load_function(spec, src)
    return fns


def get_reward_fn(data_source: str, fns: dict[str, RewardFn]) -> RewardFn:
    fn = fns.get(data_source, fns.get(EVERY_SOURCE))
    if fn is None:
        raise ConfigError(f"no reward function for data_source {data_source!r}; known: {sorted(fns)}. {ADD_ONE}")
    return fn


def check_data_sources(sources: Iterable[str], cfg: RewardConfig, samples: Optional[dict] = None) -> None:
    """Raise ConfigError if any data_source has no reward function, or a user function fails to import or, called
    once on `samples[data_source]` (a record: where, ground_truth, extra_info) with an empty response, raises or
    returns something that is not a score. Said before any process starts, instead of a failure per sample."""
    fns = reward_functions(cfg)
    # a data_source scored by reward models alone (reward.compose without 'rule') needs no reward function
    compose = lambda src: cfg.compose.get(src) or cfg.compose.get(EVERY_SOURCE) or {"rule": 1.0}  # noqa: E731
    unknown = sorted(src for src in set(sources) - set(fns) if "rule" in compose(src)) \
        if EVERY_SOURCE not in fns else []
    if unknown:
        raise ConfigError(f"no reward function for data_source {', '.join(map(repr, unknown))}; known: "
                         f"{sorted(fns)}. {ADD_ONE}")
    from mgrpo.rewards.judge import check_judges

    check_judges(cfg)  # the judges' templates, read and rendered once
    custom = cfg.custom_functions
    for src, (where, ground_truth, extra_info) in sorted((samples or {}).items()):
        key = src if src in custom else EVERY_SOURCE if EVERY_SOURCE in custom else None
        if key is None:
            continue  # a built-in: tested here, not called
        try:
            to_score(fns[key](src, "", ground_truth, extra_info))
        except Exception as e:
            raise ConfigError(f"reward.custom_functions[{key!r}]={custom[key]!r}, called once at start on the "
                             f"record at {where} with an empty response: {type(e).__name__}: {e}") from e


def to_score(value) -> float:
    """A reward function's return value as a finite float (ValueError otherwise)."""
    if isinstance(value, dict):
        if "score" not in value:
            raise ValueError(f"reward function returned a dict without 'score': keys {sorted(value)}")
        value = value["score"]
    if isinstance(value, bool):
        value = float(value)
    if isinstance(value, (str, bytes)):
        raise ValueError(f"reward function returned a string ({value!r}), not a number")
    if not isinstance(value, (int, float)):
        try:  # numpy / torch scalars
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"reward function returned {type(value).__name__}, not a number") from None
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"reward function returned a non-finite score {value}")
    return value
