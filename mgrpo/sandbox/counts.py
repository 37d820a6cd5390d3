"""Per-step counts of sandbox calls by outcome and limit, for the run's metrics.

The sandbox adds every call's result; whoever logs a step (the multi-turn rollout, a reward function's
caller) drains them once per step. Every key is present, zeros included, so a step without a timeout says
so rather than leaving the metric out.
"""

from __future__ import annotations

import threading

from mgrpo.sandbox.result import OUTCOME_KEYS, SandboxResult

EXTRA_KEYS = ("sandbox/calls", "sandbox/sandbox_errors")
"""sandbox_errors: calls the sandbox itself failed (SandboxError: it could not start), never the code's outcome."""


class OutcomeCounts:
    """Thread-safe counters: `add` per call, `drain` per step."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(OUTCOME_KEYS + EXTRA_KEYS, 0)

    def add(self, result: SandboxResult) -> None:
        with self._lock:
            self._counts["sandbox/calls"] += 1
            self._counts[f"sandbox/{result.outcome}"] += 1
            if result.limit is not None:
                self._counts[f"sandbox/limit/{result.limit}"] += 1

    def add_sandbox_error(self) -> None:
        with self._lock:
            self._counts["sandbox/calls"] += 1
            self._counts["sandbox/sandbox_errors"] += 1

    def drain(self) -> dict[str, int]:
        """The counts since the last drain (and zero them)."""
        with self._lock:
            out, self._counts = self._counts, dict.fromkeys(self._counts, 0)
        return out
