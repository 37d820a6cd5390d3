"""A hermetic local sandbox for model-written code: no network, no view of the run, limits on every resource.

`Sandbox(cfg).run(code, stdin=...) -> SandboxResult`; `mgrpo-sandbox` on the command line; `tool.python`, the
function tool of multi-turn rollouts. Standard library only (no torch, no Ray): it runs on any node.

  pool.py        `Sandbox`: fresh isolated processes, a few started ahead
  process.py     one sandboxed process, watched until its whole tree ends
  isolation.py   which isolation this machine gives (bwrap, unshare) and its command line
  probe.py       the level that works here, found by a trial program
  stub.py        the first code inside a sandbox: user, limits, then the model's code
  result.py      a call's typed result, and how an ending is classified
  counts.py      per-step counts of calls by outcome and limit
  tool.py        `python`, the code tool of multi-turn rollouts
"""

from mgrpo.sandbox.counts import OutcomeCounts
from mgrpo.sandbox.pool import Sandbox
from mgrpo.sandbox.process import SandboxError
from mgrpo.sandbox.result import Limit, Outcome, SandboxResult

__all__ = ["Limit", "Outcome", "OutcomeCounts", "Sandbox", "SandboxError", "SandboxResult"]
