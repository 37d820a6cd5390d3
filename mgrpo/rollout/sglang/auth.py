"""The rollout fleet's key: the run's secret, SGLang's rules for it, and how it reaches a server.

Anyone who can reach an engine's port could otherwise replace the model (`/update_weights_from_tensor`
unpickles its payload) or its memory. SGLang 0.5.23 takes `--api-key` (every endpoint but health,
readiness and metrics) and `--admin-api-key` (its admin endpoints: every weight-update and memory
endpoint, abort, flush, version); sglang-router takes a worker key (which it also requires from its own
clients) and control-plane keys. One secret per run serves as all of them.

- `resolve_api_key`: `rollout.api_key` -> the secret (auto: $MGRPO_ROLLOUT_API_KEY, which
  slurm/train.sbatch makes once per job and every node inherits, else a fresh random one), or None.
- `decide` / `AuthLevel`: SGLang's own `decide_request_auth` (srt/utils/auth.py, read from the wheel),
  or the same rules written from it where the wheel is missing (tests compare the two).
- `ADMIN_OPTIONAL`: the endpoints the CPU server serves that SGLang marks `AuthLevel.ADMIN_OPTIONAL`
  (tests compare with the wheel's http_server.py).
- `key_config_file`: the secret in a private YAML file that SGLang's `--config` (and the CPU server)
  reads, so that it never appears on a command line `ps` shows.
"""

from __future__ import annotations

import enum
import functools
import os
import secrets
import tempfile
from dataclasses import dataclass
from typing import Mapping, Optional

ENV_KEY = "MGRPO_ROLLOUT_API_KEY"
"""Where `rollout.api_key=auto` finds a secret made outside the driver (slurm/train.sbatch, once per job)."""
DISABLED = "none"

ALWAYS_OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""SGLang lets these through without a key (probes and Prometheus), matched by prefix."""

ADMIN_OPTIONAL = frozenset({
    "/flush_cache", "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_tensor",
    "/begin_weight_update", "/end_weight_update", "/update_weights_from_distributed", "/update_weight_version",
    "/release_memory_occupation", "/resume_memory_occupation", "/abort_request"})
"""SGLang 0.5.23 (entrypoints/http_server.py): `@auth_level(AuthLevel.ADMIN_OPTIONAL)` routes the CPU server
serves. With an admin key set they take only that key; the others (/generate, /model_info) take the API key."""


def resolve_api_key(setting: Optional[str], environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """`rollout.api_key` -> the run's secret: 'auto' ($MGRPO_ROLLOUT_API_KEY, else a fresh random key),
    'none' (no key: servers accept anyone who reaches them), 'env:NAME' (the variable NAME), or the key."""
    if setting is None or setting == "":
        raise ValueError("rollout.api_key must be 'auto', 'none', 'env:<VARIABLE>' or a key, got "
                         f"{setting!r}")
    if setting == DISABLED:
        return None
    if setting == "auto":
        # hex: a urlsafe key starts with '-' once in 64 runs, and a server would read it as a flag
        return _usable(environ.get(ENV_KEY) or secrets.token_hex(32), f"${ENV_KEY}")
    if setting.startswith("env:"):
        name = setting[4:]
        value = environ.get(name)
        if not value:
            raise ValueError(f"rollout.api_key={setting}: the environment variable {name} is not set or empty")
        return _usable(value, f"rollout.api_key={setting}")
    if any(c.isspace() for c in setting) or ":" in setting:
        # A key travels in an HTTP header and in the router's 'id:name:role:key' control-plane entry.
        raise ValueError("rollout.api_key: a key may not contain white space or ':'")
    return _usable(setting, "rollout.api_key")


def _usable(key: str, where: str) -> str:
    if key.startswith("-"):
        # SGLang's --config turns the key into `--api-key <key>`, which argparse reads as a flag
        raise ValueError(f"{where}: a key may not start with '-' (SGLang would read it as an option)")
    return key


# --- SGLang's decision ---------------------------------------------------------------------------------
class _Level(str, enum.Enum):
    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


@dataclass(frozen=True)
class _Decision:
    allowed: bool
    error_status_code: int = 401


def _check_bearer(header: Optional[str], expected: str) -> bool:
    if not header:
        return False
    parts = header.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1], expected)


def decide_fallback(*, method: str, path: str, authorization_header: Optional[str], api_key: Optional[str],
                    admin_api_key: Optional[str], auth_level) -> _Decision:
    """sglang/srt/utils/auth.py::decide_request_auth (0.5.23), for where the wheel is missing."""
    if method == "OPTIONS" or path.startswith(ALWAYS_OPEN_PREFIXES):
        return _Decision(True)
    level = _Level(getattr(auth_level, "value", auth_level))
    if level == _Level.ADMIN_FORCE:
        if not admin_api_key:
            return _Decision(False, 403)
        return _Decision(_check_bearer(authorization_header, admin_api_key))
    if level == _Level.ADMIN_OPTIONAL:
        if admin_api_key:
            return _Decision(_check_bearer(authorization_header, admin_api_key))
        if api_key:
            return _Decision(_check_bearer(authorization_header, api_key))
        return _Decision(True)
    if api_key:
        return _Decision(_check_bearer(authorization_header, api_key))
    return _Decision(True)


@functools.lru_cache(None)
def wheel_auth():
    """sglang/srt/utils/auth.py from the installed wheel (it imports nothing heavy), or None."""
    from mgrpo.rollout.sglang import schema

    path = schema._wheel_file("srt", "utils", "auth.py")
    return schema._load_file("_mgrpo_sglang_auth", path) if path else None


def decide(method: str, path: str, authorization: Optional[str], api_key: Optional[str],
           admin_api_key: Optional[str]) -> tuple[bool, int]:
    """(allowed, status when refused) for a request to one of the CPU server's routes, by SGLang's rules."""
    admin = path in ADMIN_OPTIONAL
    mod = wheel_auth()
    if mod is not None:
        level = mod.AuthLevel.ADMIN_OPTIONAL if admin else mod.AuthLevel.NORMAL
        d = mod.decide_request_auth(method=method, path=path, authorization_header=authorization, api_key=api_key,
                                    admin_api_key=admin_api_key, auth_level=level)
    else:
        d = decide_fallback(method=method, path=path, authorization_header=authorization, api_key=api_key,
                            admin_api_key=admin_api_key,
                            auth_level=_Level.ADMIN_OPTIONAL if admin else _Level.NORMAL)
    return d.allowed, d.error_status_code


# --- delivery --------------------------------------------------------------------------------------------
def key_config_file(api_key: str) -> str:
    """A YAML file, readable by this user only, that gives the key as SGLang's `--api-key` and
    `--admin-api-key` (its `--config` turns each YAML key into the flag of that spelling). The caller
    deletes it once the server has started (`remove_key_config`; the server's watchdog, should the caller
    die first): SGLang reads it once, at launch."""
    d = tempfile.mkdtemp(prefix="mgrpo-key-")  # mode 0700
    path = os.path.join(d, "server-key.yaml")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        # json.dumps quotes the key as a YAML string whatever characters it holds
        import json

        f.write(f"api-key: {json.dumps(api_key)}\nadmin-api-key: {json.dumps(api_key)}\n")
    return path


def remove_key_config(path: Optional[str]) -> None:
    if not path:
        return
    try:
        os.remove(path)
        os.rmdir(os.path.dirname(path))
    except FileNotFoundError:
        pass


def bearer(api_key: Optional[str]) -> dict:
    """The request header that carries the key (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
