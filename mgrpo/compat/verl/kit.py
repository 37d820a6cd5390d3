"""The building blocks of the veRL key table: a rule takes a key's value and every value on the command line
(some translations need two keys, e.g. min_lr_ratio x lr) and returns [(mgrpo key, value), ...], or
[("", reason)] for a key accepted and ignored, or raises Refuse(reason)."""

from __future__ import annotations

from typing import Any, Callable

A, R, F, M = ("actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.ref.",
              "actor_rollout_ref.model.")
MICRO = ("mgrpo packs micro-batches by tokens (actor.max_tokens_per_gpu); the loss is normalised over the "
         "mini-batch, so the result is the same")
TUNING = "rollout engine tuning (speed/memory only, sampling unchanged); mgrpo's SGLang launch uses its own settings"
FSDP = "FSDP engine setting (memory/speed only); mgrpo trains with Megatron"
PROFILE = "profiling/observability only"


class Refuse(Exception):
    """A key mgrpo cannot honour; the message is the reason."""


Rule = Callable[[Any, dict], list]
"""value, all veRL values of the line -> [(mgrpo key, value), ...] or [("", reason)] for accepted-and-ignored;
raises Refuse(reason)."""


def to(key: str, convert: Callable[[Any], Any] = lambda v: v) -> Rule:
    return lambda v, ctx: [(key, convert(v))]


def ignore(reason: str) -> Rule:
    return lambda v, ctx: [("", reason)]


def refuse(reason: str) -> Rule:
    def rule(v, ctx):
        raise Refuse(reason)
    return rule


def only(ok: Callable[[Any], bool], reason_ok: str, reason_refused: str) -> Rule:
    """Accepted (ignored) for values that are what mgrpo does anyway; refused otherwise."""
    def rule(v, ctx):
        if ok(v):
            return [("", reason_ok)]
        raise Refuse(reason_refused)
    return rule


def falsy(v) -> bool:
    return v in (False, None, 0, "", "none", "None", "null") or v == [] or v == {}


def hydra_value(v: Any) -> str:
    """A Python value as Hydra override text (strings quoted, so they stay strings)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{hydra_value(x)}" for k, x in v.items()) + "}"
    return "'" + str(v).replace("'", "\\'") + "'"
