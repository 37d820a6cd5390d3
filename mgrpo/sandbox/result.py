"""What one sandboxed call gave: a typed result, and how an ending is classified.

Evidence, strongest first: what the sandbox did itself (killed the tree at the wall time or the output
limit), the signal that ended the program (SIGXCPU, SIGXFSZ), then the program's own last error line
(MemoryError, EAGAIN from fork, EMFILE, EFBIG, ENOSPC): Python turns most rlimits into exceptions rather
than signals. That last kind of evidence is the program's word: code could print "MemoryError" and exit 1 to
be counted as a memory limit; it fools its own counters only, and nothing else reads them.
"""

from __future__ import annotations

import json
import re
import signal
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Optional


class Outcome(StrEnum):
    ok = "ok"
    """exit status 0"""
    error = "error"
    """the program failed on its own (an exception, a non-zero exit status, a signal that is not a limit's)"""
    timeout = "timeout"
    """the wall-clock limit (or the wait for a slot) ran out; the whole process tree was killed"""
    limit = "limit"
    """a resource limit ended it: `limit` names which"""


class Limit(StrEnum):
    wall_time = "wall_time"
    queue = "queue"
    """no slot freed within the wall time (sandbox.max_concurrency calls were running)"""
    cpu_time = "cpu_time"
    memory = "memory"
    processes = "processes"
    open_files = "open_files"
    file_size = "file_size"
    """RLIMIT_FSIZE, or the scratch tmpfs full"""
    output = "output"


OUTCOME_KEYS = tuple(f"sandbox/{o}" for o in Outcome) + tuple(f"sandbox/limit/{x}" for x in Limit)
"""Metric names of the counts (OutcomeCounts.drain): one per outcome and one per limit."""


@dataclass(frozen=True)
class SandboxResult:
    outcome: str
    """ok | error | timeout | limit (Outcome)"""
    limit: Optional[str]
    """which limit (Limit), with outcome timeout or limit; else None"""
    exit_status: Optional[int]
    """the program's exit status; -N when a signal N ended it (shell convention through bwrap: 128+N is read as
    signal N); None when the sandbox killed it"""
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    """from the code's arrival to the end of the process tree"""
    isolation: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False)

    def for_model(self) -> str:
        """What a model sees as the tool's answer: stdout, stderr, and a last line when it did not end well."""
        parts = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n") + ("\n[stdout truncated]" if self.stdout_truncated else ""))
        if self.stderr:
            parts.append(self.stderr.rstrip("\n") + ("\n[stderr truncated]" if self.stderr_truncated else ""))
        if self.outcome == Outcome.timeout:
            parts.append(f"[timeout: {self.limit}]")
        elif self.outcome == Outcome.limit:
            parts.append(f"[killed: {self.limit} limit]" if self.exit_status is None
                         else f"[{self.limit} limit, exit status {self.exit_status}]")
        elif self.outcome == Outcome.error:
            parts.append(f"[exit status {self.exit_status}]")
        return "\n".join(parts) if parts else "[no output]"


# the program's last error line -> the limit it names
_LAST_ERROR = [
    (re.compile(r"\bMemoryError\b|Unable to allocate|\[Errno 12\]|Cannot allocate memory|std::bad_alloc"),
     Limit.memory),
    (re.compile(r"\[Errno 11\]|Resource temporarily unavailable|can't start new thread"), Limit.processes),
    (re.compile(r"\[Errno 24\]|Too many open files"), Limit.open_files),
    (re.compile(r"\[Errno 27\]|File too large|\[Errno 28\]|No space left on device"), Limit.file_size),
]

_SIGNAL_LIMITS = {signal.SIGXCPU: Limit.cpu_time, signal.SIGXFSZ: Limit.file_size}


def exit_status(returncode: int) -> int:
    """The program's status from the launcher's: Popen's -N for a signal; bwrap reports signal N as 128+N."""
    if 128 < returncode < 128 + 65:
        return -(returncode - 128)
    return returncode


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b")


def _last_error_line(stderr: str) -> str:
    """The last exception line of stderr (else its last line): several processes of a fork bomb write their
    tracebacks into one pipe at once, so the last line may be another's 'Traceback (most recent call last):'."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return next((line for line in reversed(lines) if _EXCEPTION_LINE.match(line)), lines[-1] if lines else "")


def classify(*, killed_for: Optional[str], returncode: Optional[int],
             stderr: str) -> tuple[str, Optional[str], Optional[int]]:
    """(outcome, limit, exit status) of one call."""
    if killed_for == Limit.wall_time:
        return Outcome.timeout, Limit.wall_time, None
    if killed_for is not None:
        return Outcome.limit, killed_for, None
    status = exit_status(returncode)
    if status == 0:
        return Outcome.ok, None, 0
    if status < 0 and -status in _SIGNAL_LIMITS:
        # (a program that ignores SIGXCPU is killed a second later by SIGKILL, counted as an error: bwrap's
        # monitor does not reap its init, so the tree's CPU seconds are not known to tell it from any SIGKILL)
        return Outcome.limit, _SIGNAL_LIMITS[-status], status
    last = _last_error_line(stderr)
    for pattern, limit in _LAST_ERROR:
        if pattern.search(last):
            return Outcome.limit, limit, status
    return Outcome.error, None, status
