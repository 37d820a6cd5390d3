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
from mgrpo.config.validate import ConfigError, resolved_device
from mgrpo.compat.verl import user_config
from mgrpo.compat.verl.kit import Refuse, hydra_value
from mgrpo.compat.verl.layout import rollout_engines
from mgrpo.compat.verl.rules import (DEFAULT_DIFFS, INFO_CHOICES, RULES, VALUE_FLAGS, VALUE_RULES, VERL_CONFIG_NAMES,
                                     VERL_ONLY_PREFIXES, rule_for)


GPU_KEYS = frozenset({"trainer.n_gpus_per_node", "trainer.nnodes", "trainer.device"})
"""Keys by which a line asks for a GPU layout itself (on a machine without a GPU too: the preflight then says
whether it can be placed)."""


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
    flags, tokens = _split_flags(argv)
    t = _Translator()
    verl_config, user = t.config_flags(flags)
    if user is not None:
        tokens = t.user_tokens(user, tokens) + tokens
    parsed = t.parse(tokens)
    # A line without veRL-only keys is mgrpo's own and passes through untouched.
    t.verl_line = verl_config or any(o is not None and o.key_or_group not in t.shared and _is_verl_key(o.key_or_group)
                                     for _, o in parsed)
    for tok, o in parsed:
        t.token(tok, o)
    if t.out.rows and t.verl_line and t.gpu_layout():
        t.engines()
    if t.errors:
        raise VerlKeyError("cannot honour these veRL keys (remove or change them):\n  - " + "\n  - ".join(t.errors))
    return t.finish()


class _Translator:
    """One command line's translation: what it sets so far, what went wrong, the table for the user."""

    def __init__(self):
        self.out = Translation(args=[])
        self.errors: list[str] = []
        self.shared = schema_keys()
        """Keys both projects spell the same (mgrpo's schema)."""
        self.ctx: dict = {}
        """Every value of the line by key (some rules read two keys)."""
        self.groups: list[str] = []
        self.verl_line = False
        self.produced: dict[str, tuple[Any, str]] = {}
        """mgrpo key -> (value, the token that set it): two tokens setting one key differently is an error."""
        self.overrides: list[str] = []
        self.where: dict[str, str] = {}
        """token -> 'file:line' for the keys read from a user's config file (`user_config.py`)."""

    # --- the line's parts ---------------------------------------------------------------------------
    def config_flags(self, flags: list[list[str]]) -> tuple[bool, Optional[user_config.UserConfig]]:
        """Hydra's flags pass through, except veRL's --config-name/--config-path (noted in the table).
        Returns whether the line names one of veRL's trainer configs, or a user's config built on one."""
        names = {_flag_value(g)[0]: _flag_value(g)[1] for g in flags}
        config_name = (names.get("--config-name") or names.get("-cn") or "").removesuffix(".yaml")
        config_path = names.get("--config-path") or names.get("-cp")
        user = None
        found = user_config.find(config_path, config_name)
        if found is not None:
            try:
                user = user_config.read(found)
            except Refuse as r:
                self.errors.append(f"--config-name={config_name}: {r}")
                return True, None
        verl_config = config_name in VERL_CONFIG_NAMES or user is not None
        for g in flags:
            name, value = _flag_value(g)
            if user is not None and name in ("--config-name", "-cn"):
                self.out.rows.append((" ".join(g), f"{found}: {len(user.tokens)} keys over {VERL_CONFIG_NAMES[user.base]}, "
                                                   "translated below (file:line); mgrpo composes its own "
                                                   "configs/config.yaml under them"))
            elif user is not None and name in ("--config-path", "-cp"):
                self.out.rows.append((" ".join(g), f"the folder of {config_name}.yaml: read"))
            elif verl_config and name in ("--config-name", "-cn"):
                self.out.rows.append((" ".join(g), f"{VERL_CONFIG_NAMES[config_name]}: mgrpo trains with Megatron "
                                                   "from its own configs/config.yaml; veRL defaults that differ are "
                                                   "noted below"))
            elif verl_config and name in ("--config-path", "-cp"):
                self.out.rows.append((" ".join(g), f"the folder of veRL's {config_name}.yaml: not read"))
            else:
                self.out.args += g
        return verl_config, user

    def user_tokens(self, user: "user_config.UserConfig", tokens: list[str]) -> list[str]:
        """The user config's keys as tokens before the line's own; a key the line also sets is the line's
        (Hydra's precedence), and the file's value is said to be superseded."""
        on_line = {tok.lstrip("+~").split("=", 1)[0] for tok in tokens}
        out = []
        for tok, where in user.tokens:
            key = tok.split("=", 1)[0]
            if key in on_line:
                self.out.rows.append((f"{tok} ({where})", "superseded by the command line's " + key))
                continue
            self.where[tok] = where
            out.append(tok)
        return out

    def label(self, tok: str) -> str:
        """A token as the table and the errors show it: with its file:line when a config file set it."""
        return f"{tok} ({self.where[tok]})" if tok in self.where else tok

    def parse(self, tokens: list[str]) -> list:
        """(token, Hydra override or None when it does not parse), and the line's values in `ctx`."""
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from hydra.core.override_parser.types import OverrideType
        from hydra.errors import HydraException

        parser = OverridesParser.create()
        parsed = []
        for tok in tokens:
            key = tok.lstrip("+~").split("=", 1)[0]
            try:
                parsed.append((tok, parser.parse_overrides([tok])[0]))
            except HydraException as e:
                if _is_verl_key(key):
                    self.errors.append(f"{self.label(tok)}: Hydra cannot parse the value ({str(e).splitlines()[0]}); "
                                       "quote it")
                parsed.append((tok, None))
        self.ctx = {o.key_or_group: o.value() for _, o in parsed if o is not None and not o.is_sweep_override()
                    and o.type != OverrideType.DEL}
        self.groups = [o.key_or_group for _, o in parsed if o is not None and "." not in o.key_or_group]
        return parsed

    def emit(self, key, value, source, raw=False) -> None:
        if key in self.produced and self.produced[key][0] != value:
            self.errors.append(f"{self.label(source)} and {self.label(self.produced[key][1])} both set {key}, to "
                               f"{value!r} and {self.produced[key][0]!r}")
        self.produced[key] = (value, source)
        self.overrides.append(source if raw else f"{key}={hydra_value(value)}")

    # --- one token ------------------------------------------------------------------------------------
    def token(self, tok: str, o) -> None:
        from hydra.core.override_parser.types import OverrideType

        if o is None:
            self.overrides.append(tok)
            return
        key = o.key_or_group
        verl_only = key not in self.shared and _is_verl_key(key)
        rule = rule_for(key) if verl_only else VALUE_RULES.get(key) if self.verl_line else None
        if verl_only and rule is None:
            self.errors.append(f"{self.label(tok)}: no mgrpo equivalent (not translated); remove it")
            return
        if rule is None:  # mgrpo's own key (or a group): as typed, checked against what veRL keys set
            if key in self.shared and self.verl_line and not o.is_sweep_override():
                self.emit(key, o.value(), tok, raw=True)
            else:
                self.overrides.append(tok)
            return
        if o.is_sweep_override() or o.type == OverrideType.DEL:
            self.errors.append(f"{self.label(tok)}: sweeps and deletions of veRL keys are not translated")
            return
        try:
            results = rule(o.value(), self.ctx)
        except Refuse as r:
            self.errors.append(f"{self.label(tok)}: {r}")
            return
        shown = []
        for k, v in results:
            if k:
                self.emit(k, v, tok)
                shown.append(f"{k}={hydra_value(v)}")
            elif v:
                shown.append(f"ignored: {v}")
        if verl_only or shown != [f"{key}={hydra_value(o.value())}"]:  # shared keys: only when the value changed
            self.out.rows.append((self.label(tok), "; ".join(shown) if shown else
                                  "nothing (superseded by other keys of the line)"))

    # --- what the whole line implies --------------------------------------------------------------------
    def engines(self) -> None:
        """veRL's number of rollout engines (GPUs x nodes / rollout TP), as its own row."""
        try:
            engines = rollout_engines(self.ctx, set(self.ctx) | set(self.groups))
        except Refuse as r:
            self.errors.append(f"rollout engines: {r}")
            return
        if engines is not None:
            text, keys = engines
            for k, v in keys:
                self.emit(k, v, f"({text})")
            self.out.rows.append(("(veRL's rollout engines)", " ".join(f"{k}={hydra_value(v)}" for k, v in keys)
                                  + f": {text}"))

    def gpu_layout(self) -> bool:
        """Whether veRL's GPU layout (cluster=gpu, its rollout engines) applies: on a machine with an NVIDIA GPU,
        or where the line asks for GPUs itself (GPU_KEYS). On a machine without one, a line that only names
        veRL's algorithm or data keys keeps the machine's defaults: veRL's 8 GPUs per node would be placed on
        CPUs that do not exist."""
        return resolved_device("auto") == "cuda" or bool(GPU_KEYS & set(self.ctx))

    def finish(self) -> Translation:
        """veRL trains on CUDA (cluster=gpu unless the line says otherwise, or the machine has no GPU and the line
        asks for none); notes for veRL defaults that differ."""
        out = self.out
        if out.rows:
            if not {"cluster", "recipe"} & set(self.groups) and "trainer.device" not in self.ctx:
                if self.gpu_layout():
                    out.rows.insert(0, ("(veRL trains on CUDA)", "cluster=gpu (trainer.device=cuda, 8 GPUs per "
                                                                 "node)"))
                    self.overrides.insert(0, "cluster=gpu")
                else:
                    out.notes.append("this machine has no GPU: its own defaults (cluster=local_cpu, the CPU layout) "
                                     "are kept for everything the line does not set; veRL's would be cluster=gpu, "
                                     f"8 GPUs per node, rollout TP 2 (ask for them with {' or '.join(sorted(GPU_KEYS))})")
            for verl_key, verl_default, ours, our_default in DEFAULT_DIFFS:
                if verl_key not in self.ctx and ours.split("/")[0] not in self.produced:
                    out.notes.append(f"{verl_key} is unset: veRL's default is {verl_default}, mgrpo's {ours} is "
                                     f"{our_default} (set it to match veRL)")
        out.args += self.overrides
        return out
