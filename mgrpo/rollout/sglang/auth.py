"""The rollout fleet's key, our side: the run's secret, and how it reaches a server and its requests.

Anyone who can reach an engine's port could otherwise replace the model (`/update_weights_from_tensor`
unpickles its payload) or its memory. SGLang 0.5.23 takes `--api-key` (every endpoint but health,
readiness and metrics) and `--admin-api-key` (its admin endpoints: every weight-update and memory
endpoint, abort, flush, version); sglang-router takes a worker key (which it also requires from its own
clients) and control-plane keys. One secret per run serves as all of them.

- `resolve_api_key`: `rollout.api_key` -> the secret (auto: $MGRPO_ROLLOUT_API_KEY, which
  slurm/train.sbatch makes once per job and every node inherits, else a fresh random one), or None.
- `key_config_file`: the secret in a private YAML file that SGLang's `--config` (and the CPU server)
  reads, so that it never appears on a command line `ps` shows.
- `bearer`: the header every request carries.
The server's side, SGLang's rules for which request a key admits, is cpu/auth.py (the CPU server) and
protocol/tables.py (the routes' levels).
"""

from __future__ import annotations

import os
import secrets
import tempfile
from typing import Mapping, Optional

ENV_KEY = "MGRPO_ROLLOUT_API_KEY"
"""Where `rollout.api_key=auto` finds a secret made outside the driver (slurm/train.sbatch, once per job)."""
DISABLED = "none"


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
