"""Which isolation level works here, found by running a trial program under each (asked once per process).

A trial runs the whole path of a call (launcher, stub, limits, user switch) and a program that imports from
the standard library: a level whose sandbox user cannot read the interpreter's library (the unshare level
run by root, with the interpreter under a 0700 home such as pyenv's /root/.pyenv) does not work, whatever
the namespaces allow.
"""

from __future__ import annotations

import functools
import shutil
from typing import Optional

from mgrpo.config.choices import Isolation
from mgrpo.config.schema import SandboxConfig
from mgrpo.config.validate import InputError
from mgrpo.sandbox import process
from mgrpo.sandbox.isolation import RANK

TRIAL = "import json, socket, textwrap\nprint(json.dumps('ok'))"
_TRIAL_CFG = SandboxConfig(wall_time_s=30.0)


def _works(level: str) -> Optional[str]:
    try:
        result = process.run(process.start(_TRIAL_CFG, level), _TRIAL_CFG, TRIAL)
    except (OSError, process.SandboxError) as e:
        return str(e).splitlines()[0]
    if result.outcome == "ok" and result.stdout.strip() == '"ok"':
        return None
    last = (result.stderr.strip().splitlines() or [f"outcome {result.outcome}"])[-1]
    return f"a trial program failed: {last}"


@functools.lru_cache(maxsize=None)
def probe() -> dict[str, Optional[str]]:
    """Level -> None when it works on this machine, else why not. Called from one thread at a time (the
    trial's launcher dies with the thread that started it, which here is the caller, alive throughout)."""
    out: dict[str, Optional[str]] = {}
    if shutil.which("bwrap") is None:
        out[Isolation.bwrap] = "bwrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    else:
        out[Isolation.bwrap] = _works(Isolation.bwrap)
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        out[Isolation.unshare] = "util-linux's unshare/setpriv are not installed"
    else:
        out[Isolation.unshare] = _works(Isolation.unshare)
    return out


def resolve(isolation: str) -> str:
    """The level in force for `sandbox.isolation` (auto: the strongest that works), or an InputError in one
    line saying what the machine lacks."""
    found = probe()
    if isolation != Isolation.auto:
        if found[isolation] is not None:
            raise InputError(f"sandbox.isolation={isolation}: this machine cannot give it: {found[isolation]}")
        return isolation
    for level in sorted(RANK, key=RANK.get, reverse=True):
        if found[level] is None:
            return level
    raise InputError("sandbox.isolation=auto: no isolation works on this machine, refusing to run code: "
                     + "; ".join(f"{k}: {v}" for k, v in found.items()))
