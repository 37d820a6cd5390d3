"""`python`: the code tool of multi-turn rollouts, a plain function whose hints and docstring are its OpenAI
function schema (import path `mgrpo.sandbox.tool:python`).

One Sandbox per process serves every call: built on first use from `SandboxConfig()`'s defaults, or by
`configure(cfg.sandbox)` when the run starts (which prints the isolation in force). The caller that logs a
step drains `counts()` into the step's metrics. A sandbox that fails itself raises SandboxError: a failed
tool call, never an answer the model could be scored on.
"""

from __future__ import annotations

import threading
from typing import Optional

from mgrpo.config.schema import SandboxConfig
from mgrpo.sandbox.counts import OutcomeCounts
from mgrpo.sandbox.pool import Sandbox

PREFIX = "mgrpo.sandbox.tool:"
"""Function tools named with this import path run code in the sandbox."""


def gives_code_tool(multi_turn) -> bool:
    """Whether a run's rollout.multi_turn gives the model this module's code tool (its sandbox must work)."""
    return bool(multi_turn.enable) and any(t.startswith(PREFIX) for t in multi_turn.function_tools)


_lock = threading.Lock()
_sandbox: Optional[Sandbox] = None


def configure(cfg: SandboxConfig) -> Sandbox:
    """Make the process's sandbox from `cfg` (closing the one before): refuses (InputError) an isolation level
    this machine cannot give."""
    global _sandbox
    with _lock:
        if _sandbox is not None:
            _sandbox.close()
        _sandbox = Sandbox(cfg)
        return _sandbox


def sandbox() -> Sandbox:
    """The process's sandbox, made with the default config on first use."""
    global _sandbox
    with _lock:
        if _sandbox is None:
            _sandbox = Sandbox(SandboxConfig())
        return _sandbox


def close() -> None:
    """Close the process's sandbox (the next call makes a new one)."""
    global _sandbox
    with _lock:
        if _sandbox is not None:
            _sandbox.close()
        _sandbox = None


def counts() -> dict[str, int]:
    """Calls by outcome and limit since the last call of counts() (every key, zeros included)."""
    with _lock:
        made = _sandbox
    return made.counts.drain() if made is not None else OutcomeCounts().drain()


def python(code: str) -> str:
    """Run a Python program in a fresh sandbox and return its output. The program has no network and no
    files except a scratch directory; print the values you need. Standard library, NumPy and SymPy are
    available.

    Args:
        code: the Python source of the whole program.

    Returns:
        The program's stdout and stderr (truncated when long), and a last line naming the exit status, the
        timeout or the limit it hit when it did not end normally.
    """
    return sandbox().run(code).for_model()
