"""The memory planner against measurement: the CPU benchmark's measured peak per rank, and the tolerance the
estimate must meet."""

from __future__ import annotations

import tempfile


def _measure(case: str) -> list[dict]:
    from benchmarks.measure import plan_memory_cpu

    with tempfile.TemporaryDirectory() as work:
        return plan_memory_cpu.measure(case, work, malloc="mmap")


def _check(rows):
    for r in rows:
        assert abs(r["estimate_over_measured"] - 1) <= 0.25, r  # the estimate within 25% of the measured peak
