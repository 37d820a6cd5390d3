"""Reward functions keyed by data_source, with veRL's signature:

    fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None) -> float
    (a dict with a 'score' key is accepted too; its other keys are ignored)

Built-ins cover GSM8K, the math datasets (math-verify) and the synthetic tasks; users add or
override sources with reward.custom_functions = {data_source: 'module:function'}. An unknown
data_source is an error naming it and the known ones, raised by `check_data_sources` before any
process starts; `mgrpo.preflight` asks `BUILTIN_REWARDS` about the config.
"""

from __future__ import annotations

import functools
import importlib
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
}
"""The built-in judges with their default options (reward.gsm8k: strict, format_score 0)."""


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


def load_function(spec: str, data_source: str = "?") -> RewardFn:
    """Import 'package.module:function'; errors name the config entry."""
    where = f"reward.custom_functions[{data_source!r}]={spec!r}"
    problem = spec_error(spec, data_source)
    if problem:
        raise ConfigError(problem)
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"{where}: cannot import module {module_name!r} ({type(e).__name__}: {e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{where}: module {module_name!r} has no function {attr!r}")
    return fn


def reward_functions(cfg: RewardConfig) -> dict[str, RewardFn]:
    """Built-ins (with reward.gsm8k's options) overlaid with the user's functions (a custom function replaces a
    built-in)."""
    fns = builtin_rewards(gsm8k_options(cfg))
    for src, spec in cfg.custom_functions.items():
        fns[src] = load_function(spec, src)
    return fns


def get_reward_fn(data_source: str, fns: dict[str, RewardFn]) -> RewardFn:
    try:
        return fns[data_source]
    except KeyError:
        raise ConfigError(f"no reward function for data_source {data_source!r}; known: {sorted(fns)}. "
                         "Add one with reward.custom_functions={data_source: 'module:function'}") from None


def check_data_sources(sources: Iterable[str], cfg: RewardConfig) -> None:
    """Raise ValueError if any data_source has no reward function (or a custom one fails to import)."""
    fns = reward_functions(cfg)
    unknown = sorted(set(sources) - set(fns))
    if unknown:
        raise ConfigError(f"no reward function for data_source {', '.join(map(repr, unknown))}; known: "
                         f"{sorted(fns)}. Add one with reward.custom_functions={{data_source: 'module:function'}}")


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
