"""Command-line overrides checked before anything runs: a misspelt key, a value of the wrong type or outside its
choices, a config group option that does not exist, an override Hydra cannot parse. Each becomes one or two lines
naming the key (with the closest valid key for a typo) and exit status 2, instead of Hydra's error and hints.

The check composes the config once with Hydra's own API (the same composition `mgrpo-train` then runs), so it
knows exactly what Hydra knows; it only rewrites the message.
"""

from __future__ import annotations

import difflib
import os
from typing import Sequence

from mgrpo.config import ConfigError
from mgrpo.config.schema import keys_of_type, schema_keys

FLAGS_WITH_VALUES = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--info", "-i", "--experimental-rerun")


def overrides_of(argv: Sequence[str]) -> list[str]:
    """The override tokens of a Hydra command line (flags and their values left out); [] for a multirun,
    whose sweeps Hydra expands itself."""
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
            continue
        if tok in ("-m", "--multirun"):
            return []
        if tok.startswith("-"):
            skip = "=" not in tok and tok in FLAGS_WITH_VALUES
            continue
        out.append(tok)
    return out


def shaped(args: Sequence[str]) -> list[str]:
    """Overrides in the shape Hydra needs for what users type:
    - a dict-valued field (`reward.custom_functions={my_source: my_reward.py:score}`, or one entry,
      `reward.custom_functions.my_source=...`) as Hydra's add-or-replace (`++`): the field's keys are the user's,
      and Hydra's struct mode would refuse each as an unknown key;
    - one value for a list of strings (`data.train_files=train.parquet`) as a list of one (veRL takes both).
    Other tokens unchanged."""
    lists = keys_of_type(list)
    out = []
    for tok in args:
        key, eq, value = tok.lstrip("+~").partition("=")
        if in_dict(key) and eq and not tok.startswith(("~", "-")):
            tok = "++" + tok.lstrip("+")
        elif (key in lists and eq and value and value[0] not in "[$" and value != "null"
              and not set("'\"\\,") & set(value)):
            tok = f"{tok.partition('=')[0]}=['{value}']"
        out.append(tok)
    return out


def in_dict(key: str) -> bool:
    """Whether `key` is a dict-valued field or an entry of one."""
    return any(key == d or key.startswith(d + ".") for d in keys_of_type(dict))


MEANT = {
    "max_turns": "max_assistant_turns",  # veRL's multi_turn before it split turns into assistant and user ones
    "num_turns": "max_assistant_turns",
    "num_generations": "n",  # TRL's GRPOConfig
    "n_samples_per_prompt": "n",  # slime
    "learning_rate": "lr",
    "epochs": "total_epochs",
    "max_steps": "total_training_steps",
    "checkpoint_freq": "save_freq",
    "save_steps": "save_freq",
}
"""Last parts of keys that other trainers spell otherwise, to the key they mean here: a suggestion by meaning
beats one by spelling (max_turns is closest to max_user_turns in letters but means max_assistant_turns)."""


def closest(key: str) -> str:
    """' (did you mean X?)' for the schema key `key` means (MEANT), else the one nearest in spelling, or ''."""
    keys = sorted(schema_keys())
    group, _, leaf = key.rpartition(".")
    if leaf in MEANT:
        meant = [k for k in keys if k == f"{group}.{MEANT[leaf]}" or k == MEANT[leaf]]
        meant = meant or [k for k in keys if k.endswith("." + MEANT[leaf])]
        if meant:
            return f" (did you mean {meant[0]}?)"
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not match:  # a typo in the group: compare the last part within its group, then anywhere
        leaf = key.rsplit(".", 1)[-1]
        match = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1, cutoff=0.7)
        match = [k for k in keys if match and k.endswith("." + match[0])][:1]
    return f" (did you mean {match[0]}?)" if match else ""


def check(config_dir: str, argv: Sequence[str]) -> None:
    """Raise ConfigError (one or two lines) if Hydra would refuse these overrides."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    overrides = overrides_of(argv)
    known = schema_keys()
    for tok in overrides:  # '+key=value' adds a key Hydra would accept into the structured config
        if tok.startswith("+") and "=" in tok:
            key = tok.lstrip("+").split("=", 1)[0]
            if key not in known and "." in key and not in_dict(key):
                raise ConfigError(f"{tok}: unknown config key {key}{closest(key)}")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
            compose(config_name="config", overrides=list(overrides))
    except OverrideParseException as err:
        lines = str(err).splitlines()
        raise ConfigError(f"{lines[0]}: {lines[1] if len(lines) > 1 else ''}".rstrip(": ")) from None
    except MissingConfigException as err:
        raise ConfigError(_missing_option(str(err), overrides, config_dir)) from None
    except HydraException as err:
        cause = err.__cause__
        if isinstance(cause, (ConfigKeyError, AttributeError)) or "Could not override" in str(err):
            quoted = str(err).split("'")  # "Could not override 'acter.lr'." names the whole key
            key = quoted[1] if len(quoted) > 2 else getattr(cause, "full_key", "?")
            raise ConfigError(f"unknown config key {key}{closest(key)}") from None
        if isinstance(cause, OmegaConfBaseException):
            key = getattr(cause, "full_key", "?")
            raise ConfigError(f"{key}: {str(cause).splitlines()[0]}") from None
        raise ConfigError(str(err).splitlines()[0]) from None


def _missing_option(message: str, overrides: Sequence[str], config_dir: str) -> str:
    """'model=qwen3-9b: no configs/model/qwen3-9b.yaml (options: ...; did you mean qwen3-8b?)'."""
    for tok in overrides:
        group, _, option = tok.lstrip("+~").partition("=")
        folder = os.path.join(config_dir, group)
        if "." not in group and os.path.isdir(folder) and f"'{group}/{option}'" in message:
            options = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
            near = difflib.get_close_matches(option, options, n=1)
            hint = f"; did you mean {group}={near[0]}?" if near else ""
            return f"{tok}: no such {group} (configs/{group}/ has: {', '.join(options)}{hint})"
    return message.splitlines()[0]
