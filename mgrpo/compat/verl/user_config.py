"""A user's own veRL config behind `--config-path DIR --config-name NAME` (veRL's multi-turn examples turn
multi-turn on there): NAME.yaml lists one of veRL's trainer configs in its `defaults` and sets keys over it.

Its keys are read as if they were written on the command line before the line's own overrides, each named
by file and line, and go through the same translation table. Hydra's precedence holds: a key the command
line also sets is the command line's (the YAML's value is superseded, and said so). `hydra:` (veRL's search
path for its own configs) and `defaults:` are Hydra's, not settings; a default that is not veRL's trainer
config, or a second config file in `defaults`, is refused by name (mgrpo does not have veRL's config tree
to compose it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from mgrpo.compat.verl.kit import Refuse, hydra_value
from mgrpo.compat.verl.rules import VERL_CONFIG_NAMES


@dataclass(frozen=True)
class UserConfig:
    path: str
    base: str
    """The veRL trainer config its defaults build on (ppo_trainer, ...)."""
    tokens: list[tuple[str, str]]
    """(key=value as a Hydra override, 'file.yaml:line') for every leaf it sets, in file order."""
    engine: Optional[tuple[str, str]] = None
    """veRL's `override model_engine: <name>` in `defaults` (its current layout) as (model_engine=<name>,
    'file.yaml:line'): translated as the same key on the command line."""


def find(config_path: Optional[str], config_name: str) -> Optional[str]:
    """NAME.yaml in DIR, or None when the line does not point at a file of the user's."""
    if not config_path or not config_name or config_name in VERL_CONFIG_NAMES:
        return None
    path = os.path.join(config_path.removeprefix("file://"), config_name + ".yaml")
    return path if os.path.isfile(path) else None


def read(path: str) -> UserConfig:
    """The YAML's settings as override tokens; Refuse naming file:line for what cannot be read."""
    import yaml

    with open(path) as f:
        text = f.read()
    try:
        root = yaml.compose(text)
    except yaml.YAMLError as e:
        raise Refuse(f"{path}: not valid YAML ({e})") from None
    if not isinstance(root, yaml.MappingNode):
        raise Refuse(f"{path}: a veRL config is a mapping of keys")
    base, tokens, engine = None, [], None
    for key_node, value_node in root.value:
        key = key_node.value
        if key == "hydra":
            continue  # veRL's search path for its own trainer configs
        if key == "defaults":
            base, engine = _base(value_node, path)
            continue
        tokens += _leaves(key, value_node, path)
    if base is None:
        raise Refuse(f"{path}: field 'defaults' must name one of veRL's trainer configs "
                     f"({', '.join(VERL_CONFIG_NAMES)})")
    data = yaml.safe_load(text)
    out = []
    for key, where in tokens:
        value = data
        for part in key.split("."):
            value = value[part]
        out.append((f"{key}={hydra_value(value)}", where))
    if engine is not None:
        out.insert(0, engine)
    return UserConfig(path=path, base=base, tokens=out, engine=engine)


def _model_engine(item) -> Optional[str]:
    """The engine an `override model_engine: <name>` (or `model_engine: <name>`) defaults entry names, else None."""
    import yaml

    if not (isinstance(item, yaml.MappingNode) and len(item.value) == 1):
        return None
    k, v = item.value[0]
    if k.value.removeprefix("override ").strip() != "model_engine" or not isinstance(v, yaml.ScalarNode):
        return None
    return v.value


def _base(node, path: str) -> tuple[str, Optional[tuple[str, str]]]:
    import yaml

    if not isinstance(node, yaml.SequenceNode):
        raise Refuse(f"{path}:{node.start_mark.line + 1}: field 'defaults' must be a list")
    base, engine = None, None
    for item in node.value:
        where = f"{path}:{item.start_mark.line + 1}"
        name = item.value if isinstance(item, yaml.ScalarNode) else None
        if name == "_self_":
            continue
        chosen = _model_engine(item)
        if chosen is not None and engine is None:  # veRL's current layout: the trainer engine as a config group
            engine = (f"model_engine={hydra_value(chosen)}", f"{os.path.basename(path)}:{item.start_mark.line + 1}")
            continue
        if name in VERL_CONFIG_NAMES and base is None:
            base = name
            continue
        shown = name if name is not None else yaml.safe_load(yaml.serialize(item))
        raise Refuse(f"{where}: defaults entry {shown!r}: mgrpo composes its own configs/config.yaml and reads only "
                     f"one of veRL's trainer configs ({', '.join(VERL_CONFIG_NAMES)}) as the base; set that "
                     "file's keys on the command line instead")
    return base, engine


def _leaves(prefix: str, node, path: str) -> list[tuple[str, str]]:
    """(dotted key, file:line) of every leaf under `node` (lists are values, as Hydra sets them)."""
    import yaml

    if isinstance(node, yaml.MappingNode):
        out = []
        for k, v in node.value:
            out += _leaves(f"{prefix}.{k.value}", v, path)
        return out
    return [(prefix, f"{os.path.basename(path)}:{node.start_mark.line + 1}")]
