"""Which isolation level works here, found by running a trial program under each (asked once per process).

A trial runs the whole path of a call (launcher, stub, limits, user switch) and a program that imports from
the standard library: a level whose sandbox user cannot read the interpreter's library (the unshare level
run by root, with the interpreter under a 0700 home such as pyenv's /root/.pyenv) does not work, whatever
the namespaces allow.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import sys
from typing import Optional

from mgrpo.config.choices import Isolation
from mgrpo.config.schema import SandboxConfig
from mgrpo.config.validate import InputError
from mgrpo.sandbox import process
from mgrpo.sandbox.isolation import RANK, interpreter_paths

INSTALL = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora/RHEL: dnf install bubblewrap)"
"""What to do about a machine without a working level: bwrap gives every interpreter location, as root or not."""

TRIAL = "import json, socket, textwrap\nprint(json.dumps('ok'))"
_TRIAL_CFG = SandboxConfig(wall_time_s=30.0)


def closed_folder() -> Optional[str]:
    """The first folder above the interpreter that others cannot pass (a 0700 home holding pyenv or conda),
    when run by root: the unshare level runs the code as `sandbox.uid` on the host's files, which cannot
    read the interpreter's library there (bwrap binds the interpreter into a fresh root instead)."""
    if os.getuid() != 0:
        return None  # a user's sandbox runs as that user, who can read the interpreter
    for path in interpreter_paths():
        parts = path.split("/")
        for i in range(2, len(parts) + 1):
            folder = "/".join(parts[:i])
            try:
                mode = stat.S_IMODE(os.stat(folder).st_mode)
            except OSError:
                return f"{folder} (which it cannot stat)"
            if not mode & 0o001:
                return f"{folder} (mode {mode:04o})"
    return None


def _works(level: str) -> Optional[str]:
    folder = closed_folder() if level == Isolation.unshare else None
    if folder is not None:
        return (f"the interpreter ({sys.executable}) lives under {folder}, which the sandbox user cannot "
                f"enter; {INSTALL}, or run mgrpo from an interpreter outside it")
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
        out[Isolation.bwrap] = f"bwrap is not installed: {INSTALL}"
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
