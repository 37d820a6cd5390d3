"""A hermetic local sandbox for model-written code: no network, no view of the run, limits on every resource.

`Sandbox(cfg).run(code, stdin=...) -> SandboxResult`; `mgrpo-sandbox` on the command line; `tool.python`, the
function tool of multi-turn rollouts. Standard library only (no torch, no Ray): it runs on any node.
"""

from mgrpo.sandbox.counts import OutcomeCounts
from mgrpo.sandbox.pool import Sandbox
from mgrpo.sandbox.process import SandboxError
from mgrpo.sandbox.result import Limit, Outcome, SandboxResult

__all__ = ["Limit", "Outcome", "OutcomeCounts", "Sandbox", "SandboxError", "SandboxResult"]
