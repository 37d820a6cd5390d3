"""veRL command lines: translate veRL's Hydra keys into mgrpo's before Hydra composes.

    mgrpo-train algorithm.adv_estimator=grpo data.train_batch_size=1024 \\
        actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.rollout.n=5 trainer.n_gpus_per_node=8 ...

Hydra would reject veRL's keys (mgrpo's schema is strict), so `translate` rewrites the argument list
first. Every veRL key gets exactly one of three outcomes, printed as a table:
  - translated to mgrpo keys (`actor_rollout_ref.actor.optim.lr` -> `actor.lr`);
  - accepted and ignored with the reason it cannot change the result (micro-batch sizes: mgrpo packs
    by tokens and normalises the loss over the global mini-batch; engine tuning knobs; loggers mgrpo
    does not have), or because the value is what mgrpo does anyway (`param_offload=False`);
  - refused by name with the reason (`fsdp_config.param_offload=True`: mgrpo trains with Megatron and
    does not offload) -> VerlKeyError (a ConfigError: the launchers exit with status 2, no traceback).
Keys whose name is the same in both (data.train_batch_size, trainer.total_epochs, ...) pass through.
Units follow veRL: ppo_mini_batch_size counts prompts, lr_warmup_steps counts RL steps.

No torch, no Hydra composition here: the keys are parsed with Hydra's own override parser only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from mgrpo.config.schema import schema_keys
from mgrpo.config.validate import ConfigError
from mgrpo.compat.verl.kit import Refuse
from mgrpo.compat.verl.layout import rollout_engines
from mgrpo.compat.verl.rules import (DEFAULT_DIFFS, INFO_CHOICES, RULES, VALUE_FLAGS, VALUE_RULES, VERL_CONFIG_NAMES,
                                     VERL_ONLY_PREFIXES, rule_for)


class VerlKeyError(ConfigError):
    """veRL keys mgrpo cannot honour; the message names each with its reason."""


@dataclass
class Translation:
    args: list[str]
    """The argument list for Hydra: its flags and mgrpo overrides."""
    rows: list[tuple[str, str]] = field(default_factory=list)
    """(veRL key=value, what became of it)."""
    notes: list[str] = field(default_factory=list)

    @property
    def is_verl(self) -> bool:
        return bool(self.rows)

    def render(self) -> str:
        width = min(max((len(v) for v, _ in self.rows), default=0), 72)
        out = ["veRL command line translated (veRL key -> mgrpo key):"]
        out += [f"  {v:<{width}} -> {m}" for v, m in self.rows]
        out += [f"  note: {n}" for n in self.notes]
        return "\n".join(out)


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


# --- the translation -----------------------------------------------------------------------------------
def _split_flags(argv: Sequence[str]) -> tuple[list[list[str]], list[str]]:
    """Hydra's flags (each with its value, if any) and the override tokens, in order."""
    flags, overrides, i = [], [], 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("-"):
            group = [tok]
            name = tok.split("=", 1)[0]
            if "=" not in tok and i + 1 < len(argv) and (
                    name in VALUE_FLAGS or (name in ("--info", "-i") and argv[i + 1] in INFO_CHOICES)):
                group.append(argv[i + 1])
                i += 1
            flags.append(group)
        else:
            overrides.append(tok)
        i += 1
    return flags, overrides


def _flag_value(group: list[str]) -> tuple[str, Optional[str]]:
    name, _, value = group[0].partition("=")
    return name, (value if value else (group[1] if len(group) > 1 else None))


def _is_verl_key(key: str) -> bool:
    return key in RULES or key.startswith(VERL_ONLY_PREFIXES) or rule_for(key) is not None


def translate(argv: Sequence[str]) -> Translation:
    """Rewrite a command line that may hold veRL keys into mgrpo's. Raises VerlKeyError naming every key
    that cannot be honoured; returns the new argument list and the table of what became of each key."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import OverrideType
    from hydra.errors import HydraException

    flags, tokens = _split_flags(argv)
    out = Translation(args=[])
    errors: list[str] = []
    names = {_flag_value(g)[0]: _flag_value(g)[1] for g in flags}
    config_name = (names.get("--config-name") or names.get("-cn") or "").removesuffix(".yaml")
    verl_config = config_name in VERL_CONFIG_NAMES
    for g in flags:
        name, value = _flag_value(g)
        if verl_config and name in ("--config-name", "-cn"):
            out.rows.append((" ".join(g), f"{VERL_CONFIG_NAMES[config_name]}: mgrpo trains with Megatron from its "
                                          "own configs/config.yaml; veRL defaults that differ are noted below"))
        elif verl_config and name in ("--config-path", "-cp"):
            out.rows.append((" ".join(g), f"the folder of veRL's {config_name}.yaml: not read"))
        else:
            out.args += g

    parser = OverridesParser.create()
    parsed = []  # (token, override or None)
    for tok in tokens:
        key = tok.lstrip("+~").split("=", 1)[0]
        try:
            parsed.append((tok, parser.parse_overrides([tok])[0]))
        except HydraException as e:
            if _is_verl_key(key):
                errors.append(f"{tok}: Hydra cannot parse the value ({str(e).splitlines()[0]}); quote it")
            parsed.append((tok, None))
    ctx = {o.key_or_group: o.value() for _, o in parsed if o is not None and not o.is_sweep_override()
           and o.type != OverrideType.DEL}
    shared = schema_keys()
    # A line without veRL-only keys is mgrpo's own and passes through untouched.
    verl_line = verl_config or any(o is not None and o.key_or_group not in shared and _is_verl_key(o.key_or_group)
                                   for _, o in parsed)
    groups = [o.key_or_group for _, o in parsed if o is not None and "." not in o.key_or_group]
    produced: dict[str, tuple[Any, str]] = {}
    new_overrides: list[str] = []

    def emit(key, value, source, raw=False):
        if key in produced and produced[key][0] != value:
            errors.append(f"{source} and {produced[key][1]} both set {key}, to {value!r} and {produced[key][0]!r}")
        produced[key] = (value, source)
        new_overrides.append(source if raw else f"{key}={hydra_value(value)}")

    for tok, o in parsed:
        if o is None:
            new_overrides.append(tok)
            continue
        key = o.key_or_group
        verl_only = key not in shared and _is_verl_key(key)
        rule = rule_for(key) if verl_only else VALUE_RULES.get(key) if verl_line else None
        if verl_only and rule is None:
            errors.append(f"{tok}: no mgrpo equivalent (not translated); remove it")
            continue
        if rule is None:  # mgrpo's own key (or a group): as typed, checked against what veRL keys set
            if key in shared and verl_line and not o.is_sweep_override():
                emit(key, o.value(), tok, raw=True)
            else:
                new_overrides.append(tok)
            continue
        if o.is_sweep_override() or o.type == OverrideType.DEL:
            errors.append(f"{tok}: sweeps and deletions of veRL keys are not translated")
            continue
        try:
            results = rule(o.value(), ctx)
        except Refuse as r:
            errors.append(f"{tok}: {r}")
            continue
        shown = []
        for k, v in results:
            if k:
                emit(k, v, tok)
                shown.append(f"{k}={hydra_value(v)}")
            elif v:
                shown.append(f"ignored: {v}")
        if verl_only or shown != [f"{key}={hydra_value(o.value())}"]:  # shared keys: only when the value changed
            out.rows.append((tok, "; ".join(shown) if shown else "nothing (superseded by other keys of the line)"))
    if out.rows and verl_line:
        try:
            engines = rollout_engines(ctx, set(ctx) | set(groups))
        except Refuse as r:
            errors.append(f"rollout engines: {r}")
            engines = None
        if engines is not None:
            text, keys = engines
            for k, v in keys:
                emit(k, v, f"({text})")
            out.rows.append(("(veRL's rollout engines)", " ".join(f"{k}={hydra_value(v)}" for k, v in keys)
                             + f": {text}"))
    if errors:
        raise VerlKeyError("cannot honour these veRL keys (remove or change them):\n  - " + "\n  - ".join(errors))
    if out.rows:
        if not {"cluster", "recipe"} & set(groups) and "trainer.device" not in ctx:
            out.rows.insert(0, ("(veRL trains on CUDA)", "cluster=gpu (trainer.device=cuda, 8 GPUs per node)"))
            new_overrides.insert(0, "cluster=gpu")
        for verl_key, verl_default, ours, our_default in DEFAULT_DIFFS:
            if verl_key not in ctx and ours.split("/")[0] not in produced:
                out.notes.append(f"{verl_key} is unset: veRL's default is {verl_default}, mgrpo's {ours} is "
                                 f"{our_default} (set it to match veRL)")
    out.args += new_overrides
    return out
