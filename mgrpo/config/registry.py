"""Named choices of a config field (algorithm.adv_estimator, model.family, ...) and what each one is.

A `Registry` maps the names a config field accepts to entries that describe them (an estimator says
whether it needs groups of n >= 2, a policy loss whether it is token- or sequence-level). The room
that implements the choices owns its registry; `mgrpo.preflight` and the trainer ask it, so a
name is declared once. Registries live in modules that import no torch, because the validator runs
in the planner, which never imports torch; an entry whose code needs torch names that code with a
'module:attribute' target, imported on first use (`load_target`).
"""

from __future__ import annotations

import importlib
from typing import Generic, Iterator, Mapping, Optional, TypeVar

T = TypeVar("T")


class Registry(Mapping[str, T], Generic[T]):
    """name -> entry for the config field `key`, in registration order (the order messages list)."""

    def __init__(self, key: str, entries: Optional[Mapping[str, T]] = None):
        self.key = key
        self._entries: dict[str, T] = dict(entries or {})

    def __getitem__(self, name: str) -> T:
        return self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.key!r}, {list(self._entries)})"

    def register(self, name: str, entry: T, *, replace: bool = False) -> T:
        """Add `entry` under `name`; an existing name is an error unless `replace`."""
        if name in self._entries and not replace:
            raise ValueError(f"{self.key}: {name!r} is already registered")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        del self._entries[name]

    def unknown(self, name, key: Optional[str] = None) -> Optional[str]:
        """The error message for `name` if it is not registered (naming the field and the choices), else None."""
        if name in self._entries:
            return None
        return f"{key or self.key}={name!r} is not one of {list(self._entries)}"

    def lookup(self, name, key: Optional[str] = None) -> T:
        """The entry of `name`; ValueError naming the field and the choices if there is none."""
        message = self.unknown(name, key)
        if message is not None:
            raise ValueError(message)
        return self._entries[name]


def target_error(target: str, key: str = "target", what: str = "attribute") -> Optional[str]:
    """Why `target` is not a 'package.module:attribute' reference (naming `key`), or None if it is one."""
    module_name, sep, attr = str(target).partition(":")
    if not sep or not module_name or not attr:
        return f"{key}={target!r} must look like 'module:{what}'"
    return None


def load_target(target: str):
    """The object a 'package.module:attribute' target names (imported now)."""
    problem = target_error(target)
    if problem:
        raise ValueError(problem)
    module_name, _, attr = target.partition(":")
    obj = getattr(importlib.import_module(module_name), attr, None)
    if obj is None:
        raise ValueError(f"target {target!r}: module {module_name!r} has no attribute {attr!r}")
    return obj


def lazy_exports(package: str, exports: Mapping[str, str]):
    """(__getattr__, __dir__) for a package whose names {name: submodule} are imported on first use (PEP 562),
    so that importing the package loads none of them (torch stays out of whatever reads only a torch-free part).
    The package's globals are given the name once it is loaded."""
    module = importlib.import_module(package)

    def __getattr__(name: str):
        sub = exports.get(name)
        if sub is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{sub}"), name)
        setattr(module, name, value)
        return value

    def __dir__():
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__
